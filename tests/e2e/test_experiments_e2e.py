"""The runner end to end, as the researcher types it: a single run, a 2-point multirun and its
report, logger=none vs wandb offline, and the failure path (a rank that raises / is SIGKILLed /
is SIGSTOPped, Ctrl-C to the runner: the culprit is named, no process and no swap folder of the
run is left, another run's swap folder is kept).

Each run is a real ``python -m zeropp.experiments.run`` with the real ZeroEngine on a tiny model
and a few steps, so the whole file stays around a minute on 2 cores. Jobs whose subject is what the
training does rather than the launch (resume exactness of the torch trainers and of a TP run, TP
vs DP, a LoRA run's memory formula) are ``tests/distributed/test_experiments_training.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.experiment_helpers import checkpoint_steps, run_cli, run_cli_here
from zeropp.experiments.runner.metrics import SUMMARY_KEYS
from zeropp.experiments.studies.report import PLOTS
from zeropp.experiments.studies.report import main as report_main
from zeropp.runtime import checkpoint_files

FAST = ["train.steps=4", "train.micro_batch_size=4", "model=tiny", "model.seq_len=32", "data.max_bytes=200000"]


def _wait_for_training(p: subprocess.Popen, run_dir: Path, stderr: Path, timeout: float = 90) -> None:
    """Until the run in ``run_dir`` has logged a step (its ranks are training); the command must
    still be running, and within ``timeout`` s (else its stderr's tail is the failure)."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists():
        assert p.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.2)


def _live_procs_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (the run dir is in every rank's argv)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = [ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")]
            except OSError:
                continue
            if text in cmd and not (state and "Z" in state[0]):
                out.append(int(d.name))
    return out


ZEROPP_2X2 = ["stage=3", "quant=zeropp", *FAST]
"""The stage-3 ZeRO++ job (qwZ + hpZ + qgZ) on the default 2 emulated nodes x 2 ranks."""


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """:data:`ZEROPP_2X2` as typed (``python -m zeropp.experiments.run``, wandb offline): its result
    and run directory. One run serves the summary checks and, as the single launcher's reference,
    the two-torchrun-node comparison (neither the logger nor ``launcher.pg_timeout_s`` changes what
    a job computes or sends)."""
    run_dir = tmp_path_factory.mktemp("single")
    return run_cli([*ZEROPP_2X2, f"hydra.run.dir={run_dir}"]), run_dir


def test_single_run_summary_and_wandb_offline(single_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    p, tmp_path = single_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tokens/s" in p.stdout and "ZeRO-3+qwZ[int8]+hpZ+qgZ[int4]" in p.stdout  # the summary table
    s = json.loads((tmp_path / "summary.json").read_text())
    for k in SUMMARY_KEYS:
        assert k in s, k
    assert s["tokens_per_s"] > 0 and s["model_tflops"] > 0 and s["step_time_s"]["mean"] > 0
    assert s["tokens_per_step"] == 4 * 4 * 32
    by = s["comm_bytes_per_step"]["by_link"]
    assert by["intra"] > 0 and by["cross"] > 0  # 2 emulated nodes x 2
    eng = s["engine_comm_bytes_per_step"]["by_kind_link"]
    assert "bwd_all_gather.cross" not in eng or eng["bwd_all_gather.cross"] == 0  # hpZ keeps it in the node
    assert s["comm_wait_s_per_step"] >= 0
    assert len(s["memory_per_rank"]) == 4 and all(m["total"] > 0 for m in s["memory_per_rank"])
    assert 0 < s["loss"]["final"] < 6 and len(s["loss"]["curve"]) == 4
    assert not (tmp_path / "run.log").exists()  # Hydra's job log file would stay empty: not created
    assert s["config"]["zero"]["grads"]["bits"] == 4 and s["topology"]["world_size"] == 4
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["step"] == 4
    # both byte views agree (CommWatch sees only the engine's traffic plus two scalar all-reduces) ...
    wire = s["comm_bytes_per_step"]["by_link"]
    assert abs(wire["cross"] - s["engine_comm_bytes_per_step"]["by_link"]["cross"]) < 256
    # ... and the cost model's exact message sizes equal what the run measured
    from zeropp.experiments.projection.scaling_check import compare_measured

    (row,) = compare_measured([s], cross_gbps=10.0)
    assert row["bytes_error"] == 0 and row["intra_bytes_error"] == 0, row
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and s["wandb_dir"]


def test_multirun_report_and_logger_none(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    p = run_cli_here(["-m", "quant=none,int8", "topology=1x2", "logger=none", *FAST, f"hydra.sweep.dir={sweep}"], capfd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    sums = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["label"].split()[0] for s in sums] == ["ZeRO-3", "ZeRO-3+qwZ[int8]"]
    # INT8 weights: the all-gathers move about a quarter of the fp32 bytes
    ag = [sum(v for k, v in s["engine_comm_bytes_per_step"]["by_kind_link"].items() if "all_gather" in k) for s in sums]
    assert 0.2 < ag[1] / ag[0] < 0.35
    assert not any((sweep / str(i) / "wandb").exists() for i in (0, 1))  # logger=none
    r = subprocess.run(
        [sys.executable, "-m", "zeropp.experiments.report", str(sweep)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    md = (sweep / "report.md").read_text()
    assert "tokens/s" in md and "All runs: fp32, tiny model, 1x2 ranks." in md  # said once, not per run
    # runs named by what sets them apart, in words, not by their override strings
    assert "| ZeRO-3 | ZeRO-3 tiny 1x2 |" in md and "| ZeRO++ (qwZ INT8) | ZeRO-3+qwZ[int8] tiny 1x2 |" in md
    table = md.split("\n\n")[2]
    assert table.startswith("| run |") and "quant=" not in table
    assert "- ZeRO-3: `0`, `quant=none topology=1x2" in md and "- ZeRO++ (qwZ INT8): `1`, `quant=int8 " in md
    for name in PLOTS:
        assert (sweep / name).stat().st_size > 1000
        assert (sweep / name).read_bytes()[:4] == b"\x89PNG"


def _nvme(tmp_path: Path) -> tuple[list[str], Path, Path]:
    """ZeRO-Infinity overrides swapping to ``tmp_path/nvme``, which already holds another run's
    swap folder (same naming, another run id) that must survive this run."""
    nvme = tmp_path / "nvme"
    planted = nvme / "zeropp-swap-0123456789ab-r1-keepme"
    planted.mkdir(parents=True)
    (planted / "params.swp").write_bytes(b"\0" * 1024)
    return ["zero.offload_param=nvme", "zero.offload_optimizer=nvme", f"zero.nvme_path={nvme}"], nvme, planted


@pytest.mark.parametrize(
    "fault, words, status",
    [("raise@1:2", ["rank 1", "injected fault"], 1), ("kill@1:2", ["rank 1", "SIGKILL"], 128 + signal.SIGKILL)],
)
def test_failing_rank_stops_everything(
    tmp_path: Path, fault: str, words: list[str], status: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """With the nvme tier: the raising rank removes its swap folder itself; the SIGKILLed one cannot,
    and neither can its peer stuck in a collective: the launcher removes this run's folders. The
    command exits with the failing rank's status, as a shell reports it (128 + N for signal N)."""
    nvme_args, nvme, planted = _nvme(tmp_path)
    run = tmp_path / "run"
    t0 = time.monotonic()
    p = run_cli_here(
        [
            "topology=1x2",
            "logger=none",
            *FAST,
            "train.steps=50",
            "launcher.grace_s=2",
            *nvme_args,
            f"hydra.run.dir={run}",
        ],
        capfd,
        env={"ZEROPP_INJECT_FAULT": fault},
        timeout=120,
    )
    took = time.monotonic() - t0
    assert p.returncode == status, p.stderr[-3000:]
    for w in words:
        assert w in p.stderr, p.stderr[-3000:]
    assert took < 90
    assert not (run / "summary.json").exists()
    assert _live_procs_mentioning(str(run)) == []  # no orphan rank left behind
    assert os.listdir(nvme) == [planted.name] and os.listdir(planted) == ["params.swp"]


@pytest.mark.parametrize(
    "fault, why",
    [
        ("stop@1:2", "its process is not running (state T (stopped)): it was stopped (SIGSTOP"),
        ("hang@1:2", "in _maybe_fault) while ranks [0] went past that point; it is deadlocked"),
    ],
    ids=["stopped", "hung"],
)
def test_a_silent_rank_is_named_within_the_heartbeat(
    tmp_path: Path, fault: str, why: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """At step 2 rank 1 SIGSTOPs itself (the process is stopped) or its main thread hangs (other
    threads run on); rank 0 waits for it in a collective. The run fails naming rank 1 (not rank 0,
    whose collective would time out only after pg_timeout_s=120) within the heartbeat deadline,
    and every rank is gone (the stopped one continued, then terminated)."""
    t0 = time.monotonic()
    p = run_cli_here(
        [
            "topology=1x2",
            "logger=none",
            *FAST,
            "train.steps=200",
            "launcher.grace_s=1",
            "launcher.heartbeat_s=3",
            f"hydra.run.dir={tmp_path}",
        ],
        capfd,
        env={"ZEROPP_INJECT_FAULT": fault},
        timeout=120,
    )
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-3000:]
    err = p.stderr.rsplit("\nerror: ", 1)[-1]  # the runner's own line, after what the ranks printed
    assert err.startswith("rank 1 made no progress for 3 s (last seen: step "), p.stderr[-3000:]
    assert why in err and err.rstrip().endswith("stopped all ranks"), err
    assert "rank 0" not in err and "Timed out" not in p.stderr
    assert took < 60  # start-up, two steps, the 3 s deadline, the stop: far from pg_timeout_s
    assert _live_procs_mentioning(str(tmp_path)) == []


def test_ctrl_c_to_the_runner_removes_the_runs_swap_folders(tmp_path: Path) -> None:
    """SIGINT to ``python -m experiments.run`` while it trains with the nvme tier: the ranks are
    stopped, the run's swap folders are gone, another run's is kept."""
    nvme_args, nvme, planted = _nvme(tmp_path)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    with open(tmp_path / "stderr", "w") as err_file:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zeropp.experiments.run",
                "topology=1x2",
                "logger=none",
                *FAST,
                "train.steps=100000",
                "launcher.grace_s=2",
                *nvme_args,
                f"hydra.run.dir={run}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            env=env,
        )
    try:
        _wait_for_training(p, run, tmp_path / "stderr")  # training: both ranks hold their swap folders
        assert len(os.listdir(nvme)) == 3
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        if p.poll() is None:
            p.kill()
    assert "interrupted by SIGINT; all ranks stopped" in (tmp_path / "stderr").read_text()
    assert os.listdir(nvme) == [planted.name] and os.listdir(planted) == ["params.swp"]
    assert _live_procs_mentioning(str(run)) == []


def test_a_failing_multirun_job_does_not_stop_the_sweep(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Job 0 fails while training (it diverges: a failure no check before the start can see; an
    invalid config stops the whole sweep before any job, ``test_runner_in_process``); job 1 still
    runs; the command exits non-zero naming job 0, which leaves failed.json, and the report lists it.
    Two ranks per job: the sweep's handling of a failed job does not depend on the world's shape."""
    sweep = tmp_path / "sweep"
    p = run_cli_here(
        [
            "-m",
            "optim.lr=1e30,0.003",
            "topology=1x2",
            "logger=none",
            *FAST,
            "train.steps=2",
            f"hydra.sweep.dir={sweep}",
        ],
        capfd,
    )
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 multirun job(s) failed" in p.stderr and "optim.lr=1e+30" in p.stderr  # (as Hydra spells it)
    failed = json.loads((sweep / "0" / "failed.json").read_text())
    assert "diverged" in failed["error"] and failed["exit_code"] == 3
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "completed"
    report_main([str(sweep)])  # the command's own function (the command as typed: the test above)
    md = (sweep / "report.md").read_text()
    assert "(diverged at step" in md and "Failed jobs:" in md and "optim.lr=1e+30" in md
    assert "2 runs." in md and "failed (not in the table" not in md  # the diverged job is a row, counted once


def _start_runner(args: list[str], tmp_path: Path, *, launch: tuple[str, ...] = ()) -> subprocess.Popen:
    """``python -m zeropp.experiments.run`` with ``args`` on the tiny model (:data:`FAST` less its
    step count), wandb off, in the background, in a session of its own (a terminal's Ctrl-C is
    ``os.killpg(p.pid, SIGINT)``); its stdout and stderr go to ``tmp_path / "stdout"`` and
    ``"stderr"``. ``launch``: what starts the module instead of this interpreter (torchrun)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with open(tmp_path / "stdout", "w") as out_file, open(tmp_path / "stderr", "w") as err_file:
        return subprocess.Popen(
            [*(launch or (sys.executable,)), "-m", "zeropp.experiments.run", *args, "logger=none", *FAST[1:]],
            stdout=out_file,
            stderr=err_file,
            env=env,
            start_new_session=True,
        )


def test_a_sigterm_stops_the_whole_sweep(tmp_path: Path) -> None:
    """SIGTERM to a sweep while job 0 trains (``timeout``, a scheduler's preemption): job 0's ranks
    are stopped and the command exits 128 + SIGTERM; job 1 never starts (an interrupt is not one
    job's failure, after which the sweep would go on)."""
    sweep = tmp_path / "sweep"
    p = _start_runner(
        ["-m", "train.steps=100000,2", "topology=1x2", "launcher.grace_s=2", f"hydra.sweep.dir={sweep}"], tmp_path
    )
    try:
        _wait_for_training(p, sweep / "0", tmp_path / "stderr")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM, (tmp_path / "stderr").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    assert "interrupted by SIGTERM; all ranks stopped" in (tmp_path / "stderr").read_text()
    assert not (sweep / "1").exists()
    assert _live_procs_mentioning(str(sweep)) == []


def _interrupt(p: subprocess.Popen, sig: signal.Signals) -> None:
    """SIGINT as a terminal's Ctrl-C sends it (to the command's process group), SIGTERM as
    ``timeout`` / ``kill`` do (to the command alone)."""
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_every_rank_without_waiting_for_the_kill(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (or SIGTERM) while stage 3 trains and saves: a rank that leaves with a prefetch issued, or
    while its peer waits in a collective, aborts its process groups, so the peer fails at once
    instead of blocking in gloo until the launcher's SIGKILL after ``launcher.grace_s`` (90 s
    here; the command must end within half of it, with room for a loaded CI machine), and neither
    waits at exit (``CommContext.close``, 30 s) for buffers the aborted work holds (its log line). Every rank ends on its own SIGTERM: torch's "forcefully exiting via 9" never appears.
    (Whether the interrupt finds work in flight is timing; the deterministic case is
    ``tests/distributed/test_comm_lifetime.py``.) What the user sees is the runner's one line, with
    the run's last checkpoint, which is complete: no rank's traceback (a stopped rank exits 128 +
    the signal quietly, also when the stop breaks off a save) and no torch notice per rank."""
    run_dir = tmp_path / "run"
    p = _start_runner(
        ["train.steps=100000", "topology=1x2", "stage=3", "launcher.grace_s=90", "train.checkpoint_every=2"]
        + [f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    try:
        _wait_for_training(p, run_dir, tmp_path / "stderr")
        while not (run_dir / "checkpoints" / "LATEST").exists():  # one save done, the next ones to come
            assert p.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # a few steps in: gathers and reduce-scatters in flight
        _interrupt(p, sig)
        try:
            code = p.wait(timeout=45)
        except subprocess.TimeoutExpired:  # say where it hangs: the runner's and the ranks' last words
            logs = "".join(f.read_text(errors="replace")[-1500:] for f in (run_dir / "ranks").glob("rank*.log"))
            pytest.fail(f"still running 45 s after {sig.name}: {(tmp_path / 'stderr').read_text()[-1500:]}\n{logs}")
        assert code == 128 + sig, (tmp_path / "stderr").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    shown = (tmp_path / "stdout").read_text() + err
    assert "Traceback" not in shown and "Sending process" not in shown, shown[-3000:]
    assert "forcefully exiting" not in err, err[-3000:]
    step, _ = checkpoint_steps(run_dir / "checkpoints")
    last = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert last == [
        f"error: interrupted by {sig.name}; all ranks stopped; last checkpoint: step {step} in "
        f"{checkpoint_files.latest(run_dir / 'checkpoints')} (resume=true in the same run directory continues it)"
    ], err[-3000:]
    logs = "".join(f.read_text(errors="replace") for f in (run_dir / "ranks").glob("rank*.log"))
    assert "still referenced after" not in logs, logs[-3000:]  # no rank waited out CommContext.close
    assert "Traceback" not in logs and "rank 1 (pid " in logs and "stopped by SIGTERM" in logs, logs[-3000:]
    assert _live_procs_mentioning(str(run_dir)) == []


def _stop_under_torchrun(tmp_path: Path, torchrun: str, sig: signal.Signals) -> tuple[int, str]:
    """``python -m <torchrun> --standalone --nproc-per-node 2 -m zeropp.experiments.run`` (stage 3,
    training on) given ``sig`` as :func:`_interrupt` sends it, once it trains; its exit status and
    everything it printed. No process of the run is left."""
    run_dir = tmp_path / "run"
    launch = (sys.executable, "-m", torchrun, "--standalone", "--nproc-per-node", "2")
    p = _start_runner(["train.steps=100000", "stage=3", f"hydra.run.dir={run_dir}"], tmp_path, launch=launch)
    try:
        _wait_for_training(p, run_dir, tmp_path / "stderr")
        time.sleep(1.0)
        _interrupt(p, sig)
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert _live_procs_mentioning(str(run_dir)) == []
    return code, (tmp_path / "stdout").read_text() + (tmp_path / "stderr").read_text()


def test_ctrl_c_under_torchrun_is_one_line_from_the_ranks(tmp_path: Path) -> None:
    """Ctrl-C to ``torchrun ... -m zeropp.experiments.run``: torchrun's agent passes the SIGINT to
    its ranks, which stop (process groups aborted) and exit 130 without a traceback; rank 0 says
    it once, with the run's checkpoint. (torchrun's agent prints its own ``SignalException``
    traceback and exits 1: torch's code, not ours; ``experiments.torchrun``: the test below.)"""
    _, err = _stop_under_torchrun(tmp_path, "torch.distributed.run", signal.SIGINT)
    assert "[rank" not in err and "experiments/runner" not in err, err[-3000:]  # no rank's traceback
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == ["error: interrupted by SIGINT; stopped; no checkpoint (train.checkpoint_every=0)"], err[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_our_torchrun_stops_with_the_signals_status_and_no_traceback(tmp_path: Path, sig: signal.Signals) -> None:
    """``python -m zeropp.experiments.torchrun`` (torch's torchrun, its own entry) under Ctrl-C or a
    scheduler's SIGTERM (to the agent alone): the ranks stop and rank 0 says it once; the agent
    exits 128 + the signal without its ``SignalException`` traceback or its stop notices (plain
    torchrun: both, and exit 1)."""
    code, err = _stop_under_torchrun(tmp_path, "zeropp.experiments.torchrun", sig)
    assert code == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "[rank" not in err, err[-3000:]
    assert "death signal" not in err and "closing signal" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: interrupted by {sig.name}; stopped; no checkpoint (train.checkpoint_every=0)"], err


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_stopped_and_resumed_run_matches_uninterrupted(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """fp32: a run killed after its step-3 checkpoint and resumed with resume=true reaches the same
    losses as a run that never stopped (same data, LR schedule, optimizer state); resumed at another
    world size and stage it carries on from the same weights, and of the settings it changed the
    warning names the seed and the number of data-parallel ranks (both change the data)."""
    common = ["topology=1x2", "logger=none", *FAST, "train.steps=6", "stage=3", "quant=none"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    p = run_cli_here([*common, f"hydra.run.dir={ref}"], capfd)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli_here(
        [*common, "train.checkpoint_every=3", f"hydra.run.dir={cut}"], capfd, env={"ZEROPP_INJECT_FAULT": "raise@0:5"}
    )
    assert p.returncode != 0 and "injected fault" in p.stderr
    assert (cut / "checkpoints" / "LATEST").exists()
    shutil.copytree(cut / "checkpoints", tmp_path / "at3")  # the step-3 checkpoint, for the resharded resume
    p = run_cli_here([*common, "train.checkpoint_every=3", "resume=true", f"hydra.run.dir={cut}"], capfd)
    assert p.returncode == 0, p.stderr[-3000:]
    want, got = _losses(ref), _losses(cut)
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 4, logged before the stop, is not repeated
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert [got[i] for i in range(1, 7)] == [want[i] for i in range(1, 7)]  # exact in fp32
    s = json.loads((cut / "summary.json").read_text())
    assert s["first_step"] == 4 and s["steps"] == 3
    # resumed on 4 ranks at stage 1 from the 2-rank stage-3 checkpoint, with another seed: the same
    # weights carry on (different data per rank); world size and stage may change (the checkpoint
    # reshards); the warning names the seed and the data-parallel size, which both change the data
    wide = tmp_path / "wide"
    p = run_cli_here(
        [
            "topology=1x4",
            "logger=none",
            *FAST,
            "train.steps=6",
            "stage=1",
            "train.seed=1",
            "resume=true",
            f"train.checkpoint_dir={tmp_path / 'at3'}",
            f"hydra.run.dir={wide}",
        ],
        capfd,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert abs(_losses(wide)[6] - want[6]) < 0.1 * want[6]
    assert "resumed with changed settings: topology.dp_size 2 -> 4; train.seed 0 -> 1. Training" in p.stderr, p.stderr[
        -2000:
    ]
    # resume=true where there is no checkpoint: tests/unit/test_experiments_config.py (refused before any rank)


def _netns_unavailable() -> str | None:
    from zeropp.experiments.cluster import NetnsError, netns

    try:
        netns.require_privileges("zpp")
    except NetnsError as e:
        return str(e)
    return None


def _torchrun_agents(
    args: list[str], nodes: int, per_node: int, *, timeout: float = 300
) -> tuple[list[subprocess.CompletedProcess], str]:
    """Start ``nodes`` torchrun agents of ``per_node`` ranks as separate nodes (c10d rendezvous),
    each in its own network namespace of an emulated cluster, or all on loopback when namespaces
    cannot be made here; wait for them. Returns their results and where they ran."""
    from zeropp.experiments.cluster import EmulatedCluster
    from zeropp.experiments.launch import free_port

    why = _netns_unavailable()
    cluster = None if why else EmulatedCluster(nodes=nodes, ranks_per_node=per_node, inter_gbps=10.0, probe=False)
    if why:
        print(f"two-node torchrun on loopback, not namespaces: {why}")
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_INJECT_FAULT"}
    procs: list[subprocess.Popen] = []
    try:
        if cluster is not None:
            cluster.up()
            env["GLOO_SOCKET_IFNAME"] = cluster.interface
        port = free_port()
        for n in range(nodes):
            addr = cluster.node_address(n) if cluster else "127.0.0.1"
            prefix = ["ip", "netns", "exec", cluster.node_namespace(n)] if cluster else []
            # --local-addr: every namespace has this host's name, so torchrun must not resolve it
            cmd = [
                *prefix,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                str(per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{cluster.master_addr if cluster else '127.0.0.1'}:{port}",
                "--rdzv-conf",
                f"is_host={int(n == 0)}",
                "--local-addr",
                addr,
                "-m",
                "zeropp.experiments.run",
                *args,
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
                )
            )
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done, "namespaces" if cluster else "loopback"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if cluster is not None:
            cluster.down()


def test_e2e_two_torchrun_nodes_count_what_the_local_2x2_run_counts(
    tmp_path: Path, single_run: tuple[subprocess.CompletedProcess, Path]
) -> None:
    """e2e (the expensive one): two torchrun agents x 2 ranks as two nodes, each agent in its own
    network namespace of the emulated cluster (cross-node traffic crosses its link), no topology
    given: the node layout comes from torchrun (2 x 2), rank 0 alone writes the summary, and every
    byte count per step, cross-node ones included, equals the single-launcher ``topology=2x2`` run's
    for a stage-3 ZeRO++ job (qwZ + hpZ + qgZ: cross vs intra decides what is sent where)."""
    args = [*ZEROPP_2X2, "logger=none", "launcher.pg_timeout_s=60"]
    agents, where = _torchrun_agents([*args, f"hydra.run.dir={tmp_path / 'tr'}"], 2, 2)
    for a in agents:
        assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    one, one_dir = single_run  # the same job from the single launcher (its default topology: 2x2)
    assert one.returncode == 0, one.stderr[-3000:]
    # rank 0 alone summarizes: one agent prints the table, one metrics line per step
    assert [p.name for p in (tmp_path / "tr").rglob("summary.json")] == ["summary.json"]
    assert sum("tokens/s" in a.stdout for a in agents) == 1, [a.stdout[-500:] for a in agents]
    assert len((tmp_path / "tr" / "metrics.jsonl").read_text().splitlines()) == 4
    a, b = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "tr", one_dir))
    assert a["placement"] == {"cluster": "torchrun", "nodes": 2, "ranks_per_node": 2, "declared": []}, where
    assert a["topology"] == b["topology"] == {"world_size": 4, "ranks_per_node": 2, "tp": 1, "nodes": 2}
    assert set(a) == set(b) and a["label"] == b["label"] and a["tokens_per_step"] == b["tokens_per_step"]
    assert a["loss"]["curve"] == b["loss"]["curve"]  # the same job: same data, same arithmetic
    wire_a, wire_b = a["comm_bytes_per_step"], b["comm_bytes_per_step"]
    assert wire_a["by_link"]["cross"] > 0 and wire_a["by_link"]["cross"] == wire_b["by_link"]["cross"]
    assert wire_a == wire_b
    assert a["engine_comm_bytes_per_step"] == b["engine_comm_bytes_per_step"]


def test_torchrun_refuses_a_contradicting_topology(tmp_path: Path) -> None:
    """One torchrun host with 2 ranks cannot be ``topology=2x1`` (two nodes): every rank refuses
    before joining. (Sweeps under torchrun, refused by the command line's first check under the
    same environment: tests/unit/test_experiments_launch_layout.py.)"""
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "zeropp.experiments.run",
            "topology=2x1",
            "logger=none",
            *FAST,
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert bad.returncode != 0, bad.stderr[-2000:]
    assert (
        "topology says 2 nodes x 1 rank but torchrun started 1 node x 2 local ranks; drop topology.nodes "
        "topology.ranks_per_node"
    ) in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_sweep_trainers_runs_all_five(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Each job on 2 nodes x 1 rank: every trainer's traffic crosses the node link, as on the
    default 2x2, with half its rank start-ups. The 2x2 layout's two-hop paths are checked by the
    single-run test above (trainer=zeropp) and tests/distributed/test_comm_plugins.py (the FSDP2
    and DDP plug-ins on 2 nodes x 2 ranks)."""
    sweep = tmp_path / "sweep"
    p = run_cli_here(
        ["sweep=trainers", "topology=2x1", "logger=none", *FAST, "train.steps=2", f"hydra.sweep.dir={sweep}"],
        capfd,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    sums = {s["trainer"]: s for s in (json.loads(f.read_text()) for f in sweep.glob("*/summary.json"))}
    assert sorted(sums) == ["ddp", "ddp_zeropp", "fsdp2", "fsdp2_zeropp", "zeropp"]
    for name in ("zeropp", "fsdp2_zeropp", "ddp_zeropp"):
        z = sums[name]["config"]["zero"]
        assert z["grads"]["bits"] == 4, name  # quantized as promised
        assert (z["weights"] or {}).get("bits") == (None if name == "ddp_zeropp" else 8), name
    # quantized INT4 gradients move fewer bytes than the same trainer's full-precision twin
    for q, plain in (("fsdp2_zeropp", "fsdp2"), ("ddp_zeropp", "ddp")):
        assert sums[q]["comm_bytes_per_step"]["total"] < 0.6 * sums[plain]["comm_bytes_per_step"]["total"], q
