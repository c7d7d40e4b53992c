"""The command line of the doctor (see the package docstring).

    python -m zeropp.doctor                      # the table; exit 0 when nothing failed
    python -m zeropp.doctor --json doctor.json   # and the JSON report
    python -m zeropp.doctor --quick              # without the bandwidth measurements

Exit status: 0 when no check failed (skipped rows allowed), 1 when one failed or the ``--json``
report could not be written (a full disk; the table was printed), 2 for a wrong
command line (an unwritable ``--json`` path, or a ``--master-addr`` that does not resolve or is not
this host's, is refused before any check runs), 130 after Ctrl-C and 143 after SIGTERM (one line,
no report, every rank of its worlds stopped).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Optional

from ..interrupts import Terminated, sigterm_raises
from ..output_files import OutputWriteError, path_arg
from . import CHECKS, print_progress, run_checks
from .report import check_json_path, exit_status, print_report, to_json, write_json
from .result import DoctorOptions
from .world import address_problem, stop_ranks


def parse_args(argv: Optional[list[str]] = None) -> DoctorOptions:
    defaults = DoctorOptions()
    p = argparse.ArgumentParser(
        prog="python -m zeropp.doctor",
        description="Check that zeropp works on this machine (CPU half always, GPU half on CUDA).",
    )
    p.add_argument("--json", type=path_arg, metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--quick", action="store_true", help="skip the bandwidth measurements")
    p.add_argument(
        "--check-timeout", type=float, default=defaults.check_timeout_s, metavar="S",
        help=f"seconds one in-process check may take before it is reported as hung (default {defaults.check_timeout_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--world-timeout", type=float, default=defaults.world_timeout_s, metavar="S",
        help=f"seconds a process-group world may take, start to end, before its ranks are killed (default {defaults.world_timeout_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--master-addr", default=defaults.master_addr, metavar="ADDR",
        help="address the local worlds rendezvous on (default 127.0.0.1; this host's cluster address checks that interface)",
    )  # fmt: skip
    p.add_argument(
        "--gloo-ranks", type=int, default=defaults.gloo_ranks, metavar="N", help="ranks of the gloo world (default 2)"
    )
    a = p.parse_args(argv)
    unusable = address_problem(a.master_addr) if a.master_addr.strip() else None  # (blank: DoctorOptions says)
    if unusable:
        p.error(unusable)
    try:
        if a.json is not None:
            check_json_path(a.json)
        return DoctorOptions(
            quick=a.quick,
            json_path=a.json,
            check_timeout_s=a.check_timeout,
            world_timeout_s=a.world_timeout,
            master_addr=a.master_addr,
            gloo_ranks=a.gloo_ranks,
        )
    except ValueError as err:  # named as the user typed it: --check-timeout, not check_timeout_s
        msg = str(err)
        for field, flag in FLAGS.items():
            msg = msg.replace(field, flag)
        p.error(msg)  # exits 2 with the usage line


FLAGS = {
    "check_timeout_s": "--check-timeout",
    "world_timeout_s": "--world-timeout",
    "master_addr": "--master-addr",
    "gloo_ranks": "--gloo-ranks",
}
"""DoctorOptions fields -> the command-line flags that set them (for the messages)."""


def main(argv: Optional[list[str]] = None) -> int:
    """Run the checks, print the report (and write the JSON); the exit status of the report, or
    after one line 130 when Ctrl-C stops it and 143 for SIGTERM, every rank of a world it ran
    stopped first (the report of an interrupted run is not written: it would pass off the checks
    that did not run as missing)."""
    try:
        with sigterm_raises():  # ends start-up: the checks install no SIGTERM handler of their own
            options = parse_args(argv)
            t0 = time.perf_counter()
            try:
                results = run_checks(options, CHECKS, progress=print_progress)
            except BaseException:
                stop_ranks()  # a world check runs in its own thread, which the interrupt does not reach
                raise
    except (KeyboardInterrupt, Terminated) as e:
        sig = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        print(f"zeropp doctor: error: interrupted by {sig.name}; no report written", file=sys.stderr)
        return 128 + sig
    print_report(results)
    if options.json_path is not None:
        try:
            write_json(options.json_path, to_json(results, time.perf_counter() - t0))
        except OutputWriteError as e:  # a full disk: the table above stands, the JSON report is missing
            print(f"zeropp doctor: error: --json {e}", file=sys.stderr)
            return 1
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
