"""``python -m experiments.torchrun [torchrun's options] -m zeropp.experiments.run ...``: torch's
``torchrun``, stopped by Ctrl-C or SIGTERM without its traceback.

torchrun's agent passes a Ctrl-C (or a scheduler's SIGTERM) on to its ranks, which stop and say so
once (rank 0's ``error: interrupted by SIGINT; stopped; ...``, with the run's last checkpoint);
then the agent itself re-raises the signal as torch's ``SignalException`` out of its ``main``, so
Python prints that exception's traceback under the ranks' line and the command exits 1, which a
script or scheduler reads as a failure. This command is torchrun: it calls torch's own entry
(:func:`torch.distributed.run.main`: its argument parser, rendezvous, agent and failure summary,
nothing of it re-implemented), and only ends differently when a signal stopped it: exit 128 + the
signal (130 for Ctrl-C, 143 for SIGTERM, as every command here), without the traceback and without
the agent's two notices per stop (``Received SIGINT death signal, shutting down workers``,
``Sending process N closing signal SIGINT``); the ranks' own report is the one line. A Ctrl-C
or SIGTERM before any rank started (the rendezvous) is ``error: interrupted by SIGINT; stopped``
(``run_command``, as every command). A failing rank is torchrun's as ever: its
``ChildFailedError`` summary, exit 1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.run import main as torchrun_main

from ..launch.command import run_command

__all__ = ["cli", "main"]

_STOP_NOTICES = {
    "torch.distributed.elastic.agent.server.api": "Received %s death signal",
    "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal",
}
"""The agent's loggers and the start of the notice each logs once per stop (the ranks report it)."""


class _WithoutStopNotice(logging.Filter):
    """Drops one logger's stop notice (:data:`_STOP_NOTICES`); its other records pass."""

    def __init__(self, notice: str) -> None:
        super().__init__()
        self.notice = notice

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.notice)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (its command line, without the program name; None: ``sys.argv``);
    the exit status: 0 when every rank finished, 128 + the signal when one stopped the agent.
    A failing rank raises torch's ``ChildFailedError`` (after its summary was printed)."""
    filters = [(logging.getLogger(name), _WithoutStopNotice(notice)) for name, notice in _STOP_NOTICES.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        torchrun_main(None if argv is None else list(argv))
    except SignalException as e:  # the agent stopped its ranks, which said so
        return 128 + int(e.sigval)
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
    return 0


def cli() -> None:
    """The command: :func:`main` through ``run_command``, which makes a Ctrl-C or SIGTERM before the
    agent started any rank (its rendezvous) one line, ``error: interrupted by SIGINT; stopped``."""
    run_command(main)


if __name__ == "__main__":
    cli()
