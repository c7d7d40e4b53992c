"""The worker's loop is composed of collaborators; each is checked here alone, against a fake
trainer (``tests.toy_trainer.FakeTrainer``) and without a process group.

The whole loop with a registered trainer is in ``tests/distributed/test_experiments_registry.py``;
the runner's jobs (real checkpoints, a real divergence) in ``tests/e2e/``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.elastic.multiprocessing import SignalException

from tests.toy_trainer import FakeTrainer
from zeropp.experiments.runner.config import RunConfig, from_dict
from zeropp.experiments.runner.metrics import read_metrics, read_summary
from zeropp.experiments.runner.train_checkpoint import Checkpointer, divergence_guard, resume_keys
from zeropp.experiments.runner.train_data import TrainData
from zeropp.experiments.runner.train_eval import Evaluator
from zeropp.experiments.runner.train_metrics import RunMetrics
from zeropp.runtime.checkpoint_files import CheckpointError
from zeropp.runtime.divergence import DivergenceError


def _cfg(train: dict | None = None, resume: bool = False, **sections: dict) -> RunConfig:
    return from_dict(
        {
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 64, "seq_len": 8},
            "data": {"kind": "random"},
            "topology": {"nodes": 1, "ranks_per_node": 1},
            "logger": {"name": "none", "mode": "disabled"},
            "launcher": {"progress": False},
            "train": {"steps": 6, "micro_batch_size": 2, **(train or {})},
            "resume": resume,
            **sections,
        }
    )


def _diverged(cfg: RunConfig, step: int) -> DivergenceError:
    """The error the run's guard raises for a NaN loss at ``step``."""
    with pytest.raises(DivergenceError) as e:
        divergence_guard(cfg).check(step, math.nan, 1.0, False)
    return e.value


def test_data_skips_the_micro_batches_of_resumed_steps() -> None:
    cfg = _cfg(zero={"grad_accum_steps": 2})
    fresh = TrainData(cfg, 0, torch.device("cpu"))
    first_three = [fresh.step_batches() for _ in range(3)]
    assert all(len(b) == 2 for b in first_three)
    resumed = TrainData(cfg, 0, torch.device("cpu"))
    resumed.skip_steps(2)
    third = resumed.step_batches()
    for (a, b), (c, d) in zip(third, first_three[2]):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not torch.equal(first_three[0][0][0], first_three[2][0][0])


def test_evaluation_is_due_on_its_schedule_but_not_at_the_last_step() -> None:
    cfg = _cfg(train={"eval_every": 2, "eval_batches": 3})
    data = TrainData(cfg, 0, torch.device("cpu"))
    ev = Evaluator(FakeTrainer(), data, cfg.train)
    assert [s for s in range(1, 7) if ev.due(s)] == [2, 4]  # 6 is the last: the final evaluation covers it
    want = sum(float(data.batches.eval_batch(k)[0][0, 0]) for k in range(3)) / 3
    assert ev.run() == pytest.approx(want)
    assert not any(Evaluator(FakeTrainer(), data, _cfg().train).due(s) for s in range(1, 7))


def test_checkpoints_are_saved_on_schedule_and_never_after_a_divergence(tmp_path: Path) -> None:
    cfg = _cfg(train={"checkpoint_every": 2, "keep_checkpoints": 3})
    trainer = FakeTrainer()
    ckpt = Checkpointer(cfg, tmp_path, trainer, lead=True)
    assert ckpt.resume() == 0 and trainer.loads == []
    saved = [s for s in range(1, 4) if ckpt.after_step(s, diverged=False)]
    assert saved == [2] and ckpt.saved == str(tmp_path / "checkpoints") and ckpt.saved_step == 2
    path, extra, keep = trainer.saves[0]
    assert (path, extra, keep) == (
        tmp_path / "checkpoints",
        {"step": 2, "run": resume_keys(cfg), "model": cfg.to_dict()["model"], "run_dir": str(tmp_path.resolve())},
        3,
    )
    # step 4 is due but diverged: nothing is saved, the last good checkpoint stays the newest
    assert not ckpt.after_step(4, diverged=True)
    assert len(trainer.saves) == 1 and ckpt.saved_step == 2
    err = ckpt.explain(_diverged(cfg, 4), 4)
    assert f"the newest checkpoint, of step 2, is in {tmp_path / 'checkpoints'}" in str(err)
    assert "Nothing of step 4 was saved" in str(err)
    assert ckpt.after_step(6, diverged=False) and trainer.saves[-1][1]["step"] == 6  # the last step saves


def test_without_a_checkpoint_the_divergence_error_is_left_as_it_is(tmp_path: Path) -> None:
    ckpt = Checkpointer(_cfg(), tmp_path, FakeTrainer(), lead=True)
    err = _diverged(_cfg(), 1)
    assert ckpt.explain(err, 1) is err and not ckpt.after_step(6, diverged=False)


def test_resume_continues_after_the_checkpoint_and_warns_about_changed_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(resume=True)
    trainer = FakeTrainer(resume_extra={"step": 3, "run": resume_keys(cfg)})
    ckpt = Checkpointer(cfg, tmp_path, trainer, lead=True)
    assert ckpt.resume() == 3 and ckpt.saved_step == 3 and trainer.loads == [tmp_path / "checkpoints"]
    assert "warning" not in capsys.readouterr().err
    older = resume_keys(_cfg(train={"seed": 7}))
    assert Checkpointer(cfg, tmp_path, FakeTrainer(resume_extra={"step": 3, "run": older}), lead=True).resume() == 3
    err = capsys.readouterr().err
    assert f"resumed with changed settings: train.seed 7 -> {cfg.train.seed}. Training continues" in err, err
    # a longer run whose schedule does not follow train.steps continues the very same steps: no
    # warning (before: "train.steps 3 -> 6 ... will not match an uninterrupted run", after the fix the
    # refusal of a finished run advises, though an fp16 nvme run resumed so is bit-identical to the
    # uninterrupted long one)
    shorter = resume_keys(_cfg(train={"steps": 3}))  # constant schedule, no warmup
    assert Checkpointer(cfg, tmp_path, FakeTrainer(resume_extra={"step": 2, "run": shorter}), lead=True).resume() == 2
    assert "warning" not in capsys.readouterr().err
    # with a cosine schedule of the default length, that length follows train.steps: both listed
    cosine = {"schedule": "cosine"}
    longer = _cfg(resume=True, optim=cosine)
    shorter = resume_keys(_cfg(train={"steps": 3}, optim=cosine))
    assert (
        Checkpointer(longer, tmp_path, FakeTrainer(resume_extra={"step": 2, "run": shorter}), lead=True).resume() == 2
    )
    err = capsys.readouterr().err
    assert f"optim.decay_steps 3 -> {cfg.train.steps}; train.steps 3 -> {cfg.train.steps}" in err, err
    # another data-parallel world: each rank draws its own batches, so the global batch and the data
    # change (before: not listed, though the docstring promised an exact continuation)
    wider = resume_keys(_cfg(topology={"nodes": 2, "ranks_per_node": 2}))
    assert Checkpointer(cfg, tmp_path, FakeTrainer(resume_extra={"step": 3, "run": wider}), lead=True).resume() == 3
    assert "resumed with changed settings: topology.dp_size 4 -> 1. Training continues" in capsys.readouterr().err
    # the directory the weights first came from moved: the same model (the runner checked its config),
    # the weights the checkpoint's, so no warning alone; listed beside a change that warns
    same = resume_keys(cfg)
    model = cfg.to_dict()["model"] | {"pretrained": "/moved/away"}
    assert (
        Checkpointer(
            cfg, tmp_path, FakeTrainer(resume_extra={"step": 3, "run": same, "model": model}), lead=True
        ).resume()
        == 3
    )
    assert "warning" not in capsys.readouterr().err
    with_seed = {"step": 3, "run": older, "model": model}
    assert Checkpointer(cfg, tmp_path, FakeTrainer(resume_extra=with_seed), lead=True).resume() == 3
    assert "model.pretrained '/moved/away' -> None (the weights come from the checkpoint)" in capsys.readouterr().err
    done = FakeTrainer(resume_extra={"step": 6, "run": resume_keys(cfg)})
    with pytest.raises(RuntimeError, match="is at step 6 and train.steps=6: this run already finished"):
        Checkpointer(cfg, tmp_path, done, lead=True).resume()


def test_metrics_write_the_records_and_the_summary_that_reads_them(tmp_path: Path) -> None:
    """Three steps, logged every second step and at the last; the first step is not measured
    (``train.throughput_skip_steps=1``). The summary's figures come from the recorded steps."""
    cfg = _cfg(train={"steps": 3, "log_every": 2, "throughput_skip_steps": 1})
    trainer = FakeTrainer([3.0, 2.0, 1.0])
    m = RunMetrics(cfg, {}, tmp_path, rank=0, world=1, device=torch.device("cpu"), start=0, all_reduce=lambda t: None)
    m.begin(trainer)
    for step in (1, 2, 3):
        out = trainer.train_step([])
        s = m.observe(step, out, 0.25, {"all_gather.intra": 10}, 0.125, trainer)
        assert s.loss == out.loss and s.engine_bytes == {"all_gather.intra": 100}
        m.log(s, 4.0 if step == 2 else None, last=False)
    summary = m.finish(
        [m.rank_report(trainer)], eval_loss=0.5, backend="gloo", checkpoint=None, diverged=None, skipped_steps=0
    )
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [2, 3] and [r["loss"] for r in recs] == [2.0, 1.0]
    assert recs[0]["eval_loss"] == 4.0 and recs[0]["tokens_per_s"] == pytest.approx(2 * 8 / 0.25)
    assert recs[0]["comm_wait_s"] == 0.125 and recs[0]["engine_comm_bytes"] == {"all_gather.intra": 100}
    on_disk = read_summary(tmp_path / "summary.json")
    assert on_disk["status"] == "completed" and on_disk["loss"]["curve"] == [3.0, 2.0, 1.0] == summary["loss"]["curve"]
    assert on_disk["measured_steps"] == 2 and on_disk["loss"]["eval"] == 0.5
    assert on_disk["engine_comm_bytes_per_step"]["total"] == 100  # two measured steps of 100 bytes each
    assert on_disk["comm_bytes_per_step"]["by_kind_link"] == {"all_gather.intra": 10}
    assert on_disk["comm_wait_s_per_step"] == 0.125 and on_disk["memory_per_rank"] == [trainer.memory_report()]
    assert json.loads((tmp_path / "memory.json").read_text())


def test_every_rank_judges_the_means_over_ranks(tmp_path: Path) -> None:
    """The reduced figures are the means over ranks, so one rank's skipped step or NaN loss is
    seen by all (here the other rank's figures are added by a stand-in for the all-reduce)."""
    cfg = _cfg()
    other = torch.tensor([math.nan, 0.5, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    m = RunMetrics(
        cfg, {}, tmp_path, rank=1, world=2, device=torch.device("cpu"), start=0, all_reduce=lambda t: t.add_(other)
    )
    trainer = FakeTrainer([2.0])
    m.begin(trainer)
    s = m.observe(1, trainer.train_step([]), 0.1, {}, 0.25, trainer)
    assert math.isnan(s.loss) and s.skipped and s.wait == pytest.approx(0.375) and s.grad_norm == 1.0
    with pytest.raises(DivergenceError, match="step 1"):
        divergence_guard(cfg).check(1, s.loss, s.grad_norm, s.skipped)
    m.log(s, None, last=True)
    assert list(tmp_path.iterdir()) == []  # only rank 0 writes records


def _burn(cpu_s: float) -> None:
    """Spin until this thread has used ``cpu_s`` seconds of CPU."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_steps_record_the_cpu_time_of_every_thread_summed_over_ranks(tmp_path: Path) -> None:
    """``cpu_s`` is CPU time, not wall time: a step that sleeps records (almost) none, a step whose
    main thread and a second thread (as gloo's and the comm worker's) burn CPU records both, and
    the other rank's CPU time (added by a stand-in for the all-reduce) is summed, not averaged.
    The summary's ``cpu_s_per_step`` is the measured steps' sum over ranks per step."""
    cfg = _cfg(train={"steps": 3, "log_every": 1, "throughput_skip_steps": 1})
    other = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # the other rank: 1 s per step
    m = RunMetrics(
        cfg, {}, tmp_path, rank=0, world=2, device=torch.device("cpu"), start=0, all_reduce=lambda t: t.add_(other)
    )
    trainer = FakeTrainer([3.0, 2.0, 1.0])
    m.begin(trainer)
    _burn(0.05)  # step 1 (not measured)
    s1 = m.observe(1, trainer.train_step([]), 0.1, {}, 0.0, trainer)
    time.sleep(0.4)  # step 2: waits with the core idle
    s2 = m.observe(2, trainer.train_step([]), 0.4, {}, 0.0, trainer)
    helper = threading.Thread(target=_burn, args=(0.2,))
    helper.start()
    _burn(0.2)  # step 3: two threads of this process
    helper.join()
    s3 = m.observe(3, trainer.train_step([]), 0.4, {}, 0.0, trainer)
    assert 1.05 <= s1.cpu_s < 1.2
    assert 1.0 <= s2.cpu_s < 1.1  # the 0.4 s of sleep are not CPU time
    assert 1.4 <= s3.cpu_s < 1.6
    for s in (s1, s2, s3):
        m.log(s, None, last=s.step == 3)
    assert [r["cpu_s"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [s1.cpu_s, s2.cpu_s, s3.cpu_s]
    mine = m.rank_report(trainer)
    assert mine["cpu_s"] == pytest.approx(s2.cpu_s + s3.cpu_s - 2.0)  # this rank's own, measured steps only
    other_rank = dict(mine, rank=1, cpu_s=2.0)
    summary = m.finish(
        [mine, other_rank], eval_loss=None, backend="gloo", checkpoint=None, diverged=None, skipped_steps=0
    )
    assert summary["cpu_s_per_step"] == pytest.approx((s2.cpu_s + s3.cpu_s) / 2)
    assert read_summary(tmp_path / "summary.json")["cpu_s_per_step"] == pytest.approx(summary["cpu_s_per_step"])
    without = m.finish(
        [{k: v for k, v in mine.items() if k != "cpu_s"}],
        eval_loss=None,
        backend="gloo",
        checkpoint=None,
        diverged=None,
        skipped_steps=0,
    )
    assert without["cpu_s_per_step"] is None  # a report without CPU time (an older rank report): no figure


def test_each_nodes_first_rank_records_its_uplink_bytes_on_an_emulated_cluster(tmp_path: Path, monkeypatch) -> None:
    """On ``cluster=emulated`` the first rank of each node reads its node's uplink counter (the
    interface ``GLOO_SOCKET_IFNAME`` names) around every step; the measured steps' bytes go into
    its report and the summary's ``uplink_tx_bytes_per_step`` is their mean over nodes per step,
    the figure ``experiments.bench_cluster`` compares with the projection (before: no run recorded
    it, so that comparison never ran). Other ranks and ``cluster=local`` record none."""
    from zeropp.experiments.runner import train_metrics

    counters = {"zpp-up": iter([1000, 1500, 2300, 3000])}  # begin, after steps 1, 2, 3
    monkeypatch.setattr(train_metrics, "interface_tx_bytes", lambda name: next(counters[name]))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "zpp-up")
    train = {"steps": 3, "throughput_skip_steps": 1}
    emulated = _cfg(train=train, topology={"nodes": 2, "ranks_per_node": 2}, cluster={"name": "emulated"})
    reports = []
    for rank, cfg in ((0, emulated), (1, emulated), (0, _cfg(train=train))):
        m = RunMetrics(
            cfg, {}, tmp_path / str(len(reports)), rank=rank, world=1, device=torch.device("cpu"), start=0,
            all_reduce=lambda t: None,
        )  # fmt: skip
        trainer = FakeTrainer([3.0, 2.0, 1.0])
        m.begin(trainer)
        for step in (1, 2, 3):
            m.observe(step, trainer.train_step([]), 0.25, {}, 0.0, trainer)
        reports.append(m.rank_report(trainer))
    assert [r["uplink_tx_bytes"] for r in reports] == [800 + 700, None, None]  # steps 2 and 3 of node 0's counter
    node1 = dict(reports[0], rank=2, uplink_tx_bytes=2500)
    summary = m.finish(
        [reports[0], reports[1], node1, reports[1]],
        eval_loss=None, backend="gloo", checkpoint=None, diverged=None, skipped_steps=0,
    )  # fmt: skip
    assert summary["uplink_tx_bytes_per_step"] == (1500 + 2500) / (2 * 2)
    local = m.finish([reports[2]], eval_loss=None, backend="gloo", checkpoint=None, diverged=None, skipped_steps=0)
    assert local["uplink_tx_bytes_per_step"] is None


def _save_broken_off_by_sigterm(spec: dict) -> None:
    """A rank whose checkpoint save the launcher's SIGTERM broke off: the save's error handling
    turns the stop into the ``CheckpointError`` every rank raises."""
    from zeropp.experiments.runner import worker

    try:
        worker._raise_on_sigterm(signal.SIGTERM, None)
    except SignalException as e:
        raise CheckpointError(f"checkpoint save failed on rank(s) [1] of 2: rank 1: {e}", {1: str(e)}) from None


def _worker_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Any) -> int:
    """The worker's entry as rank 1 of a launched world (its spec, and so its log, in ``tmp_path``)
    with ``run`` as the rank's training; the SIGTERM handler and the stack log restored after."""
    from zeropp.experiments.runner import worker

    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(worker, "run_rank", run)
    before = signal.getsignal(signal.SIGTERM)
    try:
        return worker.main(["worker", str(spec)])
    finally:
        signal.signal(signal.SIGTERM, before)  # the handler ignores SIGTERMs after the first
        worker._stack_log.clear()


@pytest.mark.parametrize("stop", ["sigterm", "sigterm mid-save", "sigint"])
def test_a_stopped_rank_exits_with_the_signals_status_and_no_traceback(
    stop: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The worker's entry for a rank the launcher stops (Ctrl-C, ``timeout``, a failing peer):
    128 + the signal, one line in the rank's log and no traceback, also when the stop surfaces as
    another error (a save it broke off); a rank's own error still propagates (for ``@record``)."""
    from zeropp.experiments.runner import worker

    def run(spec: dict) -> None:
        worker._stopped_by.clear()
        if stop == "sigterm":
            worker._raise_on_sigterm(signal.SIGTERM, None)
        elif stop == "sigint":
            raise KeyboardInterrupt
        _save_broken_off_by_sigterm(spec)

    code = _worker_main(tmp_path, monkeypatch, run)
    sig = signal.SIGINT if stop == "sigint" else signal.SIGTERM
    assert code == 128 + sig
    assert capfd.readouterr().err == f"rank 1 (pid {os.getpid()}) stopped by {sig.name}\n"

    def own_error(spec: dict) -> None:
        worker._stopped_by.clear()
        raise CheckpointError("checkpoint save failed on rank(s) [1] of 2: rank 1: OSError: disk full", {})

    with pytest.raises(CheckpointError, match="disk full"):
        _worker_main(tmp_path, monkeypatch, own_error)


def _stuck_in_the_training_loop() -> None:
    """Where the launcher's SIGTERM finds the rank (a frame its log must name)."""
    from zeropp.experiments.runner import worker

    worker._raise_on_sigterm(signal.SIGTERM, None)


def test_a_sigterm_while_unwinding_from_the_ranks_own_error_keeps_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's SIGTERM (a failing peer's, the timeout's) may land while the rank unwinds from
    its own error (destroying the process group). Before: the stop replaced it (the error only its
    ``__context__``) and the rank said just ``rank 1 stopped by SIGTERM``, exit 143. Now the rank's
    own error propagates (for ``@record`` and its log), noting the stop."""
    from zeropp.experiments.runner import worker

    def run(spec: dict) -> None:
        worker._stopped_by.clear()
        try:
            raise ValueError("the rank's own bug")
        finally:
            _stuck_in_the_training_loop()  # the SIGTERM lands in the cleanup

    with pytest.raises(ValueError, match="the rank's own bug") as info:
        _worker_main(tmp_path, monkeypatch, run)
    assert any("stopped: SignalException" in n for n in info.value.__notes__)
    assert worker.stopped_status(SignalException("x", sigval=signal.SIGTERM)) == 128 + signal.SIGTERM


def test_a_stop_while_unwinding_from_a_peers_exit_is_a_stop_not_an_error() -> None:
    """Ctrl-C under torchrun stops every rank; the one that leaves first closes its connections under
    the others' collectives, whose ``Connection closed by peer`` the stop then interrupts. That error
    is the peer's exit, not the rank's own: the rank exits 130 quietly (before: its traceback)."""
    from zeropp.experiments.runner import worker

    def stopped_while(cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            finally:
                raise KeyboardInterrupt()
        except KeyboardInterrupt as e:
            return e

    for left in (
        RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:38576"),
        # rank 0 hosts the store: a roll call's key read after it left (torch's DistNetworkError)
        RuntimeError(
            "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"
        ),
        RuntimeError(
            "rank 0 (pid 31827) exited while rank 1 waited for it in a shared-memory collective (zero.transport=shm)"
        ),
    ):
        peer = stopped_while(left)
        assert worker.own_error(peer) is None and worker.stopped_status(peer) == 128 + signal.SIGINT, left
    own = stopped_while(ValueError("the rank's own bug"))
    assert isinstance(worker.own_error(own), ValueError) and worker.stopped_status(own) is None


def test_a_stopped_rank_writes_where_it_was_to_its_own_log_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A run stopped by ``launcher.timeout_s`` or the heartbeat monitor: each rank's log shows where
    it was (every thread's stack; before: nothing once the stop exited quietly); the terminal stays
    one line."""
    from zeropp.experiments.runner import worker

    def run(spec: dict) -> None:
        worker._stopped_by.clear()
        _stuck_in_the_training_loop()

    assert _worker_main(tmp_path, monkeypatch, run) == 128 + signal.SIGTERM
    log = (tmp_path / "rank1.log").read_text()
    assert "stopped by SIGTERM here" in log and "_stuck_in_the_training_loop" in log
    assert "Thread 0x" in log or "Current thread" in log  # faulthandler's every-thread dump
    assert capfd.readouterr().err == f"rank 1 (pid {os.getpid()}) stopped by SIGTERM\n"


def test_resume_warns_when_the_transport_resolves_otherwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each checkpoint records the resolved transport; a resume on which ``zero.transport=auto``
    resolves to the other one (or whose checkpoint did not record one) is told, naming both: its
    all-reduces differ from the checkpointed run's in the last bit. The same transport says nothing."""
    cfg = _cfg(resume=True)
    saver = FakeTrainer(transport="backend")
    assert Checkpointer(_cfg(train={"checkpoint_every": 2}), tmp_path, saver, lead=True).after_step(2, diverged=False)
    extra = saver.saves[0][1]
    assert extra["transport"] == "backend"
    same = FakeTrainer(resume_extra=extra, transport="backend")
    assert Checkpointer(cfg, tmp_path, same, lead=True).resume() == 2
    assert "warning" not in capsys.readouterr().err
    other = FakeTrainer(resume_extra=extra, transport="shm")
    assert Checkpointer(cfg, tmp_path, other, lead=True).resume() == 2
    err = capsys.readouterr().err
    assert "resumed with changed settings: the transport of the plain collectives 'backend' -> 'shm'" in err, err
    unrecorded = FakeTrainer(resume_extra={k: v for k, v in extra.items() if k != "transport"}, transport="shm")
    assert Checkpointer(cfg, tmp_path, unrecorded, lead=True).resume() == 2
    assert "the transport of the plain collectives not recorded -> 'shm'" in capsys.readouterr().err
