"""What the benchmark command lines (``bench_gpu``, ``bench_fsdp``, ``bench_cluster``, ``bench_peers``)
share: argument checks, each refusing a count below its floor with argparse's usage error (exit
status 2) and naming the flag as the user typed it, and interleaved rounds of runner jobs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from zeropp.output_files import OutputFileError, check_output_file, json_file_is

from ..runner.config import ConfigError, run_records
from ..runner.preflight import check_writable_dir


def flag(name: str) -> str:
    """The command-line spelling of argparse destination ``name`` (``micro_batch`` -> ``--micro-batch``)."""
    return "--" + name.replace("_", "-")


def check_fresh_out(p: argparse.ArgumentParser, out: str | None, rows: Iterable[str] = ()) -> None:
    """``--out`` must not hold an earlier benchmark's runs: the runner refuses a fresh run where a
    run's records are (``experiments.runner.run_dir_checks.check_fresh_run_dir``), so every row would fail
    one by one; this says so once, before the first row. Nor may it hold, under a name of ``rows``
    (the folders this invocation writes its jobs into, relative to ``--out``), anything but an empty
    folder: the jobs would write their logs and records among files the benchmark did not write."""
    if out is None:
        return
    root = Path(out)
    if root.exists() and not root.is_dir():
        p.error(f"--out {out} is not a directory; choose a new --out (or leave it out for a temporary directory)")
    try:
        check_writable_dir("--out", root)
    except ConfigError as e:  # before: a FileNotFoundError / NotADirectoryError traceback from the first row
        p.error(str(e).removeprefix("invalid config: "))
    runs = (
        {f.parent for name in ("summary.json", "metrics.jsonl") for f in root.rglob(name)} if root.is_dir() else set()
    )
    held = sorted(d for d in runs if run_records(d))
    if held:
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        p.error(
            f"--out {out} already holds runs ({held[0]}{more}), which this benchmark's runs would overwrite; "
            "choose a new --out (or leave it out for a temporary directory)"
        )
    for name in rows:
        d = root / name
        if d.is_symlink() or (d.exists() and not (d.is_dir() and not any(d.iterdir()))):
            p.error(
                f"--out {out} already holds {d}, where this benchmark would write its {name} job; nothing was "
                "run and it is untouched: choose a new --out (or leave it out for a temporary directory)"
            )


def check_json_output(p: argparse.ArgumentParser, path: str | None, flag: str, shape: Callable[[Any], bool]) -> None:
    """A ``--json FILE`` (or another JSON output) the benchmark can write at its end, checked before
    it measures anything: argparse's usage error (exit 2) for a directory, a directory refusing new
    files, or an existing file that is not JSON of the benchmark's own ``shape`` (a user's file is
    never overwritten; zeropp.output_files)."""
    if path is None:
        return
    try:
        check_output_file(Path(path), flag, ours=lambda f: json_file_is(f, shape))
    except OutputFileError as e:
        p.error(str(e))


def json_with_keys(*keys: str) -> Callable[[Any], bool]:
    """The shape test of a JSON object holding at least ``keys`` (a benchmark's ``--json`` document)."""
    return lambda doc: isinstance(doc, dict) and all(k in doc for k in keys)


def check_jobs(p: argparse.ArgumentParser, jobs: Mapping[str, Sequence[str]]) -> None:
    """Compose and validate every row's runner job (row -> its overrides) before the first starts:
    a setting the runner refuses (a preset that does not exist, a learning rate of NaN) is one
    usage error (exit 2) naming the row, not the same failure printed once per row with exit status
    1 after the rows before it ran. The host's own limits: :func:`check_hosts`."""
    from ..runner.compose import compose_run

    for key, overrides in jobs.items():
        try:
            compose_run(overrides)
        except ConfigError as e:
            p.error(f"row {key}: {e}")


def check_hosts(prog: str, jobs: Mapping[str, Sequence[str]]) -> None:
    """Before the first row, the runner's checks of this host for every row (its ranks all start
    here: ``preflight.check_local_ranks``, GPUs, CPU ranks, memory): exit 2 with ``prog: error:
    row ...`` instead of every row failing alike. Run only when the real runner runs the rows."""
    from ..runner.compose import compose_run
    from ..runner.preflight import check_local_ranks

    for key, overrides in jobs.items():
        try:
            check_local_ranks(compose_run(overrides))
        except ConfigError as e:
            print(f"{prog}: error: row {key}: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def require_at_least(p: argparse.ArgumentParser, a: argparse.Namespace, names: Iterable[str], low: int) -> None:
    """``p.error`` (exit 2) for the first of ``names`` whose parsed value is below ``low``."""
    for name in names:
        value = getattr(a, name)
        if value < low:
            p.error(f"{flag(name)} must be >= {low}, got {value}")


def check_run_lengths(p: argparse.ArgumentParser, a: argparse.Namespace, counts: Iterable[str]) -> None:
    """The checks every benchmark makes: each of ``counts`` (steps, batch sizes, ...) >= 1, and
    ``--warmup`` >= 0."""
    require_at_least(p, a, counts, 1)
    require_at_least(p, a, ("warmup",), 0)


def round_order(keys: Sequence[str], r: int) -> list[str]:
    """The rows of round ``r`` (from 0): ``keys`` rotated by ``r``, so each row takes each place in turn."""
    k = r % len(keys) if keys else 0
    return [*keys[k:], *keys[:k]]


def interleaved_rounds(
    keys: Sequence[str],
    rounds: int,
    run: Callable[[str, int], dict[str, Any]],
    runs: dict[str, list[dict[str, Any]]],
    errors: dict[str, dict[str, Any]],
) -> None:
    """Run the rows ``keys`` for ``rounds`` interleaved rounds (round ``r`` in :func:`round_order`):
    ``run(key, r)``'s result is appended to ``runs[key]``. A row not in ``runs`` (one that cannot run
    here) is passed over; a run that fails (``ConfigError``, ``RankFailure``) records ``errors[key]``,
    says so on stderr, and its row is not run again while the others go on. The benchmark itself
    stopped (``RunInterrupted``) propagates, with ``runs`` / ``errors`` holding what finished."""
    from ..runner.config import ConfigError
    from ..runner.launcher import RankFailure, RunInterrupted

    for r in range(rounds):
        for key in round_order(keys, r):
            if key not in runs or key in errors:
                continue
            try:
                runs[key].append(run(key, r))
            except RunInterrupted:  # (a RankFailure too) the benchmark was stopped, not this row
                raise
            except (ConfigError, RankFailure) as e:
                errors[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{key}: failed: {e}", file=sys.stderr)
