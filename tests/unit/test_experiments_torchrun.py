"""``python -m experiments.torchrun``: torch's torchrun entry, ended by a signal with the signal's
status and no traceback; its stop notices dropped, its other records and errors kept. (With a
real torchrun and ranks: ``tests/e2e/test_experiments_e2e.py``.)"""

from __future__ import annotations

import logging
import signal

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

import zeropp.experiments.runner.torchrun as ours

AGENT = logging.getLogger("torch.distributed.elastic.agent.server.api")
PROCESSES = logging.getLogger("torch.distributed.elastic.multiprocessing.api")


def _agent_stopped_by(sig: signal.Signals):
    def torchrun_main(argv: list[str] | None) -> None:
        AGENT.warning("Received %s death signal, shutting down workers", sig)
        PROCESSES.warning("Sending process %s closing signal %s", 123, sig.name)
        PROCESSES.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 123, sig, "SIGKILL")
        raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)

    return torchrun_main


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_agent_exits_with_the_signals_status_without_its_notices(
    sig: signal.Signals, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ours, "torchrun_main", _agent_stopped_by(sig))
    with caplog.at_level(logging.WARNING):
        assert ours.main(["--standalone", "-m", "x"]) == 128 + sig
    assert [r.getMessage() for r in caplog.records] == [
        f"Unable to shutdown process 123 via {sig}, forcefully exiting via SIGKILL"  # not a notice: kept
    ]
    assert AGENT.filters == [] and PROCESSES.filters == []  # removed again


def test_ctrl_c_before_any_rank_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def rendezvous(argv: list[str] | None) -> None:
        raise KeyboardInterrupt  # Python's handler: the agent installs torch's only when ranks start

    monkeypatch.setattr(ours, "torchrun_main", rendezvous)
    with pytest.raises(SystemExit) as e:
        ours.cli()
    assert e.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err == "error: interrupted by SIGINT; stopped\n"


def test_a_finished_run_is_0_and_a_failure_stays_torchruns(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str] | None] = []
    monkeypatch.setattr(ours, "torchrun_main", seen.append)
    assert ours.main(["--nproc-per-node", "2", "-m", "x"]) == 0 and seen == [["--nproc-per-node", "2", "-m", "x"]]

    def failing(argv: list[str] | None) -> None:
        raise RuntimeError("a rank failed (torchrun's ChildFailedError summary)")

    monkeypatch.setattr(ours, "torchrun_main", failing)
    with pytest.raises(RuntimeError, match="a rank failed"):
        ours.main([])
