"""Every bad input is refused before any rank starts: one ``error: ...`` line naming the key, the
value and what is allowed, exit 2. Each fault is provoked for real (a missing or unreadable
corpus, an unwritable directory, a topology too big for this host) through the runner's own
command line, run in-process (``cli_helpers.run_cli``) so no rank or interpreter starts.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_experiments_inputs.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import ValidationError

from tests.cli_helpers import ROOT, run_cli, unwritable_dir
from tests.experiment_helpers import composed_config
from zeropp.disk_space import FreeSpace
from zeropp.experiments.runner import preflight
from zeropp.experiments.runner.config import MODEL_KINDS, SECTION_CLASSES, ConfigError, DataConfig, from_dict
from zeropp.experiments.runner.console import human_bytes
from zeropp.experiments.runner.overrides import check_overrides
from zeropp.runtime import OptimizerConfig, ZeroConfig


def _space(nbytes: int) -> FreeSpace:
    """A filesystem with ``nbytes`` free, no reserve: for faking ``preflight.disk_space``."""
    return FreeSpace(usable=nbytes, shown=nbytes)


@pytest.fixture
def cli(tmp_path, monkeypatch, capfd):
    """``cli(*args)`` -> the runner's stderr, after checking it exited 2 with one ``error:`` line."""

    def call(*args: str) -> str:
        code, err = run_cli(list(args), tmp_path / "run", monkeypatch, capfd)
        assert code == 2, err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return call


# ------------------------------------------------------------------ keys the data source would ignore
@pytest.mark.parametrize(
    "args, words",
    [
        (["data.path=/nonexistent"], ["data.path='/nonexistent'", "data.source=python_stdlib", "add data.source=path"]),
        (["data=random", "data.path=/tmp"], ["data.path='/tmp'", "data.kind=random", "data=text"]),
        (["data=random", "data.max_bytes=100000"], ["data.max_bytes=100000", "data.kind=random"]),
        (["data=random", "data.val_fraction=0.1"], ["data.val_fraction=0.1", "data.kind=random"]),
        (["data=licenses", "data.kind=random"], ["data.source='path'", "data.kind=random"]),
        (["data.max_bytes=2000"], ["data.max_bytes=2000", ">= 4096"]),
    ],
)
def test_a_data_key_the_source_ignores_is_refused(cli, args: list[str], words: list[str]) -> None:
    line = cli(*args)
    assert all(w in line for w in words), line


def test_data_keys_at_their_defaults_are_accepted() -> None:
    assert from_dict(composed_config("data=random")).data == DataConfig(kind="random")
    assert from_dict(composed_config("data.kind=random")).data.kind == "random"  # the text defaults are not "set"
    assert (
        from_dict(composed_config("data.source=path", "data.path=/x")).data.path == "/x"
    )  # existence: checked by the runner


# ------------------------------------------------------------------ the corpus, read before the ranks
def test_missing_corpus_path_is_refused_before_ranks(cli) -> None:
    line = cli("data.source=path", "data.path=/nonexistent")
    assert "data.path='/nonexistent' does not exist" in line, line


def test_short_or_unreadable_corpus_is_refused_before_ranks(cli, tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 100)
    assert "data.path=" in (line := cli("data.source=path", f"data.path={small}")) and "100 bytes" in line, line
    one_seq = tmp_path / "one.txt"
    one_seq.write_bytes(b"y" * 5000)  # enough bytes, but not one window of model.seq_len=8000
    line = cli("data.source=path", f"data.path={one_seq}", "model.seq_len=8000")
    assert "model.seq_len=8000" in line and "shorter than one training sequence" in line, line
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block forever
    assert "neither a file nor a directory" in cli("data.source=path", f"data.path={fifo}")
    if ROOT:  # permission bits do not stop root; a file the kernel refuses to read does
        unreadable = "/proc/self/mem"
    else:
        unreadable = tmp_path / "secret.txt"
        unreadable.write_bytes(b"z" * 10_000)
        unreadable.chmod(0)
    line = cli("data.source=path", f"data.path={unreadable}")
    assert "cannot read" in line and str(unreadable) in line, line


# ------------------------------------------------------------------ values of the wrong type
@pytest.mark.parametrize(
    "arg, message",
    [
        ("train.steps=abc", "train.steps=abc: expected an integer"),
        ("train.seed=1.5", "train.seed=1.5: expected an integer"),
        ("train.steps=1e3", "train.steps=1e3: expected an integer"),
        ("stage=three", "stage=three: expected an integer"),
        ("resume=maybe", "resume=maybe: expected true or false"),
        ("optim.lr=fast", "optim.lr=fast: expected a number"),
        ("optim.betas=0.9", "optim.betas=0.9: expected a list"),
        ("optim.betas=[0.9,abc]", "optim.betas=[0.9,abc]: expected a number"),
        ("zero.grad_clip=big", "zero.grad_clip=big: expected a number or null"),
        ("train.steps=null", "train.steps=null: expected an integer (this key cannot be null)"),
    ],
)
def test_wrong_type_is_one_clear_line(arg: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_overrides([arg])
    assert message in str(e.value), str(e.value)
    with pytest.raises((HydraException, ValidationError)):  # the reference: Hydra refuses it too
        composed_config(arg)


@pytest.mark.parametrize(
    "arg",
    [
        "train.steps='3'",
        "train.steps=int(3.0)",
        "optim.lr=1",
        "zero.grad_clip=null",
        "optim.betas=[0.8,0.95]",
        "train.checkpoint_dir=null",
        "resume=true",
    ],
)
def test_values_hydra_accepts_pass_the_precheck(arg: str) -> None:
    check_overrides([arg])
    composed_config(arg)  # the reference: Hydra composes it


def test_sweep_values_are_each_checked() -> None:
    with pytest.raises(ConfigError, match=r"train\.steps=x: expected an integer"):
        check_overrides(["-m", "train.steps=1,2,x"])
    check_overrides(["-m", "train.steps=range(1,4)", "train.seed=1,2"])


def test_wrong_type_on_the_command_line_exits_2(cli) -> None:
    assert "train.steps=abc: expected an integer" in cli("train.steps=abc")
    assert "train.seed=1.5: expected an integer" in cli("train.seed=1.5")


# ------------------------------------------------------------------ inf and nan
def _float_keys() -> list[tuple[str, str]]:
    """Every float key of every section (``key``, the value that sets it to inf)."""
    out = []
    for section, cls in {**SECTION_CLASSES, "model": MODEL_KINDS["hf"]}.items():
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(tp) is tuple and float in typing.get_args(tp):
                out.append((f"{section}.{f.name}", "[0.9,{}]"))
            elif tp is float or float in typing.get_args(tp):
                out.append((f"{section}.{f.name}", "{}"))
    return out


FLOAT_KEYS = _float_keys()


def test_the_float_keys_are_found() -> None:
    keys = {k for k, _ in FLOAT_KEYS}
    assert {
        "optim.lr",
        "optim.betas",
        "zero.loss_scale_init",
        "zero.grad_clip",
        "cluster.inter_gbps",
        "launcher.timeout_s",
        "logger.init_timeout_s",
        "data.val_fraction",
    } <= keys, keys


@pytest.mark.parametrize("key, form", FLOAT_KEYS)
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_every_float_key_refuses_non_finite(key: str, form: str, bad: str) -> None:
    context = {"cluster": ["cluster=emulated"], "zero": ["zero.precision=fp16"]}.get(key.split(".")[0], [])
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config(*context, f"{key}={form.format(bad)}"))
    assert f"{key}=" in str(e.value) and "finite" in str(e.value), str(e.value)


def test_library_configs_refuse_non_finite() -> None:
    for kw in ({"lr": math.inf}, {"eps": math.inf}, {"weight_decay": math.nan}, {"lr": math.nan}):
        with pytest.raises(ValueError, match="finite"):
            OptimizerConfig(**kw)
    for kw in ({"loss_scale_init": math.inf}, {"grad_clip": math.inf}, {"grad_clip": math.nan}):
        with pytest.raises(ValueError, match="finite"):
            ZeroConfig(**kw)


@pytest.mark.parametrize(
    "args, key",
    [
        (["cluster=emulated", "cluster.inter_gbps=inf"], "cluster.inter_gbps=inf"),
        (["optim.lr=inf"], "optim.lr=inf"),
        (["zero.precision=fp16", "zero.loss_scale_init=inf"], "zero.loss_scale_init=inf"),
        (["optim.lr=nan"], "optim.lr=nan"),
    ],
)
def test_non_finite_on_the_command_line_exits_2(cli, args: list[str], key: str) -> None:
    line = cli(*args)
    assert key in line and "finite" in line, line


# ------------------------------------------------------------------ this host's size
def test_more_local_ranks_than_the_host_can_run(cli) -> None:
    line = cli("topology.nodes=1000")
    bound = preflight.RANKS_PER_CPU * preflight.host_cpus()
    assert "topology.nodes=1000" in line and "2000 ranks" in line and f"at most {bound} local CPU ranks" in line, line


def test_local_rank_bound_is_exact() -> None:
    n = preflight.RANKS_PER_CPU * preflight.host_cpus()
    preflight.check_local_ranks(
        from_dict(composed_config("model=tiny", f"topology.nodes={n}", "topology.ranks_per_node=1"))
    )
    with pytest.raises(ConfigError, match=f"{n + 1} ranks"):
        preflight.check_local_ranks(
            from_dict(
                composed_config(
                    "model=tiny", f"topology.nodes={n + 1}", "topology.ranks_per_node=1", "launcher.device=cpu"
                )
            )
        )


@pytest.mark.parametrize(
    "overrides",
    [
        ["stage=0"],
        ["stage=1"],
        ["stage=2"],
        ["stage=3"],
        ["stage=3", "quant=zeropp"],
        ["stage=2", "zero.precision=bf16"],
        ["stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],
        ["stage=1", "zero.offload_optimizer=cpu"],
    ],
)
def test_memory_estimate_is_the_formula_of_experiments_memory(overrides: list[str]) -> None:
    from zeropp.experiments.runner.memory import predictions

    rc = from_dict(composed_config("model=small", *overrides))
    chosen = next(r for r in predictions(rc) if r["chosen"])  # the reference: what experiments.runner.memory prints
    got = preflight.model_state_per_rank(rc)
    assert got == pytest.approx(chosen["tiers"]), (got, chosen["tiers"])


def test_memory_estimate_of_other_trainers_and_lora() -> None:
    from zeropp.experiments.runner.memory import predictions
    from zeropp.models import GPT

    ddp = from_dict(composed_config("model=small", "trainer=ddp"))  # DDP holds stage 0's replicas
    ref = next(r for r in predictions(from_dict(composed_config("model=small", "stage=0"))) if r["chosen"])
    assert preflight.model_state_per_rank(ddp) == pytest.approx(ref["tiers"])
    rc = from_dict(composed_config("model=tiny", "model.lora_rank=4", "stage=3"))
    frozen = sum(p.numel() for p in GPT(rc.model).parameters() if not p.requires_grad)  # the real model's frozen base
    assert rc.model.with_(lora_rank=0).num_params() == frozen
    full = preflight.model_state_per_rank(from_dict(composed_config("model=tiny", "stage=3")))
    assert preflight.model_state_per_rank(rc)["device"] < full["device"]  # no optimizer state for the frozen base


def test_model_states_beyond_host_memory(cli) -> None:
    big = ["model.d_model=16384", "model.n_layers=64", "model.n_heads=16", "launcher.device=cpu"]
    rc = from_dict(composed_config(*big))
    per_rank = max(preflight.model_state_per_rank(rc)["device"], 4.0 * rc.model.num_params())
    assert per_rank * 4 > preflight.host_memory()  # the premise: 2x2 CPU ranks of it cannot fit
    line = cli(*big)
    assert human_bytes(per_rank * 4) in line and human_bytes(preflight.host_memory()) in line, line
    assert f"{rc.model.num_params():,}" in line and "host memory" in line, line


@pytest.mark.parametrize("setting", ["zero.swap_buffer_size=10000000000", "zero.swap_buffers=100000"])
def test_nvme_staging_buffers_beyond_host_memory_name_the_buffer_keys(cli, tmp_path, setting: str) -> None:
    """A tiny model whose nvme staging buffers do not fit: the refusal names the buffer keys to
    lower (before: it blamed the model state and advised a smaller model or zero.offload_*=nvme,
    the tier already in use)."""
    line = cli("model=tiny", "zero.offload_optimizer=nvme", f"zero.nvme_path={tmp_path}", setting)
    assert setting in line and "nvme staging buffers per rank" in line, line
    assert "Lower zero.swap_buffer_size" in line and "smaller model" not in line, line


@pytest.mark.parametrize("offload", [[], ["zero.offload_param=cpu"], ["zero.offload_optimizer=cpu"]])
def test_a_persistence_threshold_above_every_parameter_is_refused(cli, offload: list[str]) -> None:
    """DeepSpeed's default stage3_param_persistence_threshold (1e5) on model=small keeps every
    parameter whole on every rank: the stage-3 run held stage 0's memory (and offload_param moved
    nothing) without a word. Refused before any rank, naming the largest parameter."""
    line = cli("model=small", "stage=3", "zero.persistence_threshold=100000", *offload)
    assert "zero.persistence_threshold=100000 is above every parameter" in line, line
    assert "the largest has 65,536 elements" in line and "at most 65,536" in line, line
    assert ("zero.offload_param=cpu would move nothing" in line) == ("zero.offload_param=cpu" in offload), line
    # the advice keeps the run's other settings possible (stage 0 takes no optimizer offload)
    assert ("stage=1 with zero.offload_optimizer=cpu" if "zero.offload_optimizer=cpu" in offload else "stage=0") in line


# ------------------------------------------------------------------ the checkpoint directory


def test_unwritable_checkpoint_dir_is_refused_before_ranks(cli, tmp_path) -> None:
    target = f"{unwritable_dir(tmp_path)}/ckpt"
    line = cli("train.checkpoint_every=5", f"train.checkpoint_dir={target}")
    assert f"train.checkpoint_dir='{target}' cannot be written" in line, line
    afile = tmp_path / "afile"
    afile.write_text("mine")
    line = cli("train.checkpoint_every=5", f"train.checkpoint_dir={afile}/ckpt")
    assert "is not a directory" in line and str(afile) in line, line
    assert afile.read_text() == "mine"


def test_an_nvme_path_that_takes_no_files_is_refused_before_ranks(cli) -> None:
    """/proc is a directory whose mode bits allow root to write, but no file can be created in it: the
    swap space would fail on every rank after the start; the preflight tries for real."""
    line = cli("zero.offload_optimizer=nvme", "zero.nvme_path=/proc")
    # (not root: the library's own check of the mode bits refuses it first, in its words)
    assert "nvme_path='/proc'" in line and ("cannot be written" in line or "not writable" in line), line


def test_an_nvme_disk_too_small_for_the_swap_files_is_refused_before_ranks(cli, tmp_path, monkeypatch) -> None:
    """The swap files are preallocated when each rank's engine starts: a disk that cannot hold them
    (a small tmpfs) used to stop every rank after start-up; the preflight compares ZeRO's disk tier
    for all local ranks with the free space under zero.nvme_path."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = [
        "model=small",
        "stage=3",
        "zero.offload_optimizer=nvme",
        "zero.offload_param=nvme",
        f"zero.nvme_path={nvme}",
    ]
    rc = from_dict(composed_config(*args))
    need = preflight.model_state_per_rank(rc)["disk"] * rc.topology.world_size
    monkeypatch.setattr(preflight, "disk_space", lambda path: _space(int(need) - 1))
    line = cli(*args)
    assert f"zero.nvme_path='{nvme}'" in line and human_bytes(need) in line and "free" in line, line
    assert "larger disk" in line, line
    assert list(nvme.iterdir()) == []  # no swap folder made


def test_a_full_nvme_disk_names_the_swap_folders_left_on_it(cli, tmp_path, monkeypatch) -> None:
    """A SIGKILLed runner cannot remove its ranks' swap folders (docs/reliability.md, known limits);
    when the disk is then too small for the next run, the refusal names them and their size, and
    touches nothing."""
    nvme = tmp_path / "nvme"
    left = nvme / "zeropp-swap-0123456789ab-r0-abcd1234"
    left.mkdir(parents=True)
    (left / "optimizer.swp").write_bytes(b"\0" * 3000)
    (nvme / "notes.txt").write_text("mine")
    monkeypatch.setattr(preflight, "disk_space", lambda path: _space(1 if str(path).startswith(str(nvme)) else 1 << 40))
    line = cli("zero.offload_optimizer=nvme", f"zero.nvme_path={nvme}")
    assert "It holds 1 swap folder(s) of other runs (2.93 KiB: zeropp-swap-0123456789ab-r0-abcd1234)" in line, line
    assert sorted(p.name for p in nvme.iterdir()) == ["notes.txt", left.name] and (left / "optimizer.swp").exists()


def test_writable_check_creates_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # restored afterwards
    before = sorted(tmp_path.rglob("*"))
    preflight.check_writable_dir("train.checkpoint_dir", tmp_path / "a" / "b")  # nearest existing: tmp_path
    preflight.check_writable_dir("train.checkpoint_dir", tmp_path)
    assert sorted(tmp_path.rglob("*")) == before
    gone = tmp_path / "gone"
    gone.mkdir()
    os.chdir(gone)  # a relative path under a deleted working directory: refused, not looped on
    try:
        gone.rmdir()
        with pytest.raises(ConfigError, match=r"'a/b' cannot be written: \. does not let this process create"):
            preflight.check_writable_dir("train.checkpoint_dir", Path("a/b"))
    finally:
        os.chdir(tmp_path)
    # not saving (only resuming from it): the directory is not written, so not checked
    rc = from_dict(
        composed_config(
            "train.checkpoint_every=0", "resume=true", f"train.checkpoint_dir={unwritable_dir(tmp_path)}/ckpt"
        )
    )
    preflight.check_before_launch(rc, tmp_path, local=False)


# ------------------------------------------------------------------ the rest of the audit
@pytest.mark.parametrize(
    "args, words",
    [
        (["cluster.inter_gbps=3"], ["cluster.inter_gbps=3.0", "cluster=local", "add cluster=emulated"]),
        (["cluster.inter_latency_ms=5"], ["cluster.inter_latency_ms=5.0", "cluster=local"]),
        (["logger=none", "logger.mode=online"], ["logger.mode='online'", "logger=none"]),
        (["logger=none", "logger.entity=me"], ["logger.entity='me'", "logger=none"]),
        (["logger.init_timeout_s=0"], ["logger.init_timeout_s=0.0", "> 0"]),
        (["train.seed=4294967296"], ["train.seed=4294967296", "[0, 2**32)"]),
        (["train.checkpoint_dir="], ["train.checkpoint_dir=''", "null"]),
        (["launcher.pg_timeout_s=1e15"], ["launcher.pg_timeout_s=1000000000000000.0", "<= 1e+09"]),
        (["train.checkpoint_dir=/tmp/x"], ["train.checkpoint_dir='/tmp/x'", "checkpoint_every=0", "resume=true"]),
        (["train.keep_checkpoints=5"], ["train.keep_checkpoints=5", "checkpoint_every=0"]),
        (["zero.swap_buffers=8"], ["zero.swap_buffers=8", "no nvme tier", "zero.offload_optimizer=nvme"]),
        (["zero.swap_buffer_size=1024"], ["zero.swap_buffer_size=1024", "no nvme tier"]),
        (["stage=0", "zero.prefetch_depth=3"], ["zero.prefetch_depth=3", "stage=0", "set stage=3"]),
        (["stage=2", "zero.prefetch_depth=0"], ["zero.prefetch_depth=0", "stage=2"]),
        (
            ["stage=3", "zero.quantize_frozen=int8"],
            ["zero.quantize_frozen=", "model.lora_rank=0", "set model.lora_rank=N"],
        ),
    ],
)
def test_audit_refusals(cli, args: list[str], words: list[str]) -> None:
    line = cli(*args)
    assert all(w in line for w in words), line


@pytest.mark.parametrize(
    "args",
    [
        ["train.checkpoint_every=0", "resume=true", "train.checkpoint_dir=/tmp/x"],  # loaded from
        ["train.checkpoint_every=2", "train.checkpoint_dir=/tmp/x", "train.keep_checkpoints=5"],
        ["zero.offload_optimizer=nvme", "zero.nvme_path=/tmp", "zero.swap_buffers=8"],
        ["stage=3", "zero.prefetch_depth=3"],
        ["stage=1", "zero.prefetch_depth=1"],  # the default: nothing set
        ["stage=3", "model.lora_rank=4", "zero.quantize_frozen=int8"],
    ],
)
def test_the_same_settings_where_they_are_read_are_accepted(args: list[str]) -> None:
    from_dict(composed_config(*args))


@pytest.mark.parametrize("name", ["ZEROPP_DEBUG_STREAMS", "ZEROPP_DEBUG_COLLECTIVES"])
def test_a_mistyped_debug_mode_is_refused_before_ranks(cli, monkeypatch, name: str) -> None:
    """Each rank reads the debug modes again at its first communication; a typo stops the run here first."""
    monkeypatch.setenv(name, "yes")
    line = cli("model=tiny")
    assert line.startswith("error: invalid environment:") and f"{name}='yes'" in line, line


def test_an_emulated_cluster_of_one_node_is_refused_before_anything_is_built(cli, tmp_path) -> None:
    """``cluster=emulated topology=1x2`` has no cross-node link to shape: it ran as a plain local run
    whose summary recorded ``inter_gbps`` as its link rate (``scaling_check`` then printed
    ``links: cross 1 Gbit/s`` for a run nothing crossed). Refused before any namespace or rank."""
    line = cli("cluster=emulated", "topology=1x2", "cluster.inter_gbps=5")
    assert "topology 1x2 has one node" in line and "cluster.inter_gbps=5 would do nothing" in line
    assert "topology=2x2" in line and "cluster=local" in line
    assert not (tmp_path / "run" / "ranks").exists()
    preflight.check_emulated_nodes(from_dict(composed_config("cluster=emulated", "topology=2x1")))


def test_an_output_directory_on_a_full_disk_is_refused_before_hydra(tmp_path, monkeypatch, capfd) -> None:
    """Before: Hydra's OSError traceback (No space left on device) writing its ``.hydra/`` files,
    for ``hydra.run.dir`` on a full disk and for the default ``outputs/`` under a full working
    directory; an empty file can still be created there, so the writable check alone passed."""
    from tests.runtime_helpers import tiny_tmpfs

    with tiny_tmpfs(tmp_path) as full:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        try:  # fill every block
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(ConfigError, match=r"hydra.run.dir='.*run' is on a full disk \(0 B free at .*tiny\)"):
            check_overrides([f"hydra.run.dir={full}/run"])
        monkeypatch.chdir(full)
        try:
            for args, line in (
                (["train.steps=2"], r"error: invalid config: hydra.run.dir='outputs/.*' is on a full disk"),
                (["-m", "train.steps=2,3"], r"error: invalid config: hydra.sweep.dir='multirun/.*' is on a full disk"),
            ):
                code, err = run_cli([*args, "model=tiny"], None, monkeypatch, capfd)
                assert code == 2 and re.search(line, err) and "Traceback" not in err, err
        finally:
            monkeypatch.chdir(tmp_path)  # out of the tmpfs, so that it can be unmounted
        check_overrides(["train.steps=2"])  # (the composing helpers, which write elsewhere, do not check it)
        assert sorted(p.name for p in full.iterdir()) == ["fill"]  # nothing created
    monkeypatch.setattr(preflight, "disk_space", lambda path: _space(preflight.MIN_OUTPUT_FREE))  # at the floor: fine
    check_overrides([f"hydra.run.dir={tmp_path}/run"])


def _users_config_dir(tmp_path: Path, key: str, folder: str) -> Path:
    """A ``--config-dir`` holding a group option ``place/custom.yaml`` that sets ``key`` (``run`` /
    ``sweep``) ``.dir`` for the whole config, as a user's own yaml does."""
    conf = tmp_path / "userconf"
    (conf / "place").mkdir(parents=True)
    (conf / "place" / "custom.yaml").write_text(f"# @package _global_\nhydra:\n  {key}:\n    dir: {folder}\n")
    return conf


@pytest.mark.parametrize("sweep", [False, True])
def test_an_output_directory_a_config_file_sets_is_the_one_checked(tmp_path, monkeypatch, capfd, sweep) -> None:
    """``hydra.run.dir`` (``hydra.sweep.dir``) set in a user's yaml rather than on the command line:
    the folder Hydra composes is checked before Hydra writes there. Before: the check before Hydra
    looked at the default ``outputs/`` (``multirun/``), passed, and Hydra failed creating the real
    folder with an ``OSError`` traceback, exit 1."""
    key = "sweep" if sweep else "run"
    bad = f"{unwritable_dir(tmp_path)}/runs/a"
    conf = _users_config_dir(tmp_path, key, bad)
    flags = ["-m"] if sweep else []
    args = [*flags, "--config-dir", str(conf), "+place=custom", "model=tiny"] + (["train.steps=2,3"] if sweep else [])
    monkeypatch.chdir(tmp_path)  # (the default outputs/ would be writable here)
    code, err = run_cli(args, None, monkeypatch, capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert f"hydra.{key}.dir='{bad}' cannot be written" in lines[0], lines[0]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.parametrize("sweep", [False, True])
def test_a_users_own_primary_config_gets_the_output_directory_check(tmp_path, monkeypatch, capfd, sweep) -> None:
    """``--config-dir DIR --config-name mine``, where ``mine.yaml`` does not inherit the package's
    ``/config`` (so none of its settings): the runner registers the check itself, so the folder that config sets is still
    checked before Hydra writes there. Before: no check, Hydra's ``OSError`` traceback, exit 1."""
    key = "sweep" if sweep else "run"
    bad = f"{unwritable_dir(tmp_path)}/runs/a"
    conf = tmp_path / "ownconf"
    conf.mkdir()
    (conf / "mine.yaml").write_text(f"train:\n  steps: 2\nhydra:\n  {key}:\n    dir: {bad}\n")
    args = ["-m"] if sweep else []
    args += ["--config-dir", str(conf), "--config-name", "mine"] + (["train.steps=2,3"] if sweep else [])
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(args, None, monkeypatch, capfd)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert f"hydra.{key}.dir='{bad}' cannot be written" in lines[0], lines[0]


def test_the_default_outputs_are_not_refused_for_a_run_a_config_file_puts_elsewhere(tmp_path, monkeypatch) -> None:
    """The composed folder, not ``outputs/``, is what the check looks at: a yaml moving the run to a
    writable disk is let through even where ``outputs/`` could not be written."""
    from hydra import compose, initialize_config_dir

    import zeropp.experiments.runner.run  # noqa: F401 - the schema and the resolvers
    from zeropp.experiments.runner.output_dir_check import check_output_dir

    conf = _users_config_dir(tmp_path, "run", str(tmp_path / "mine"))
    (conf / "config.yaml").write_text("defaults:\n  - /config\n  - _self_\n")
    checked: list[tuple[str, Path]] = []
    monkeypatch.setattr(
        "zeropp.experiments.runner.output_dir_check.check_writable_dir", lambda k, p: checked.append((k, p))
    )
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("place/custom", return_hydra_config=True)
    check_output_dir(cfg, "hydra.run.dir")
    assert checked == [("hydra.run.dir", tmp_path / "mine")]
