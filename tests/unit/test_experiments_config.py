"""Config: every library setting is an override, each declared once, and every bad input is one
clear error that names the key, before any rank starts.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/e2e/test_experiments_config.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_module

from tests.cli_helpers import run_cli
from tests.experiment_helpers import CLI_ERRORS, composed_config
from tests.experiment_helpers import run_cli as run_cli_subprocess
from zeropp.comm import Topology
from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.experiments.runner.config import SECTION_CLASSES, ConfigError, from_dict, from_omegaconf
from zeropp.experiments.runner.overrides import check_overrides, group_options
from zeropp.experiments.runner.schema import run_schema
from zeropp.models import GPTConfig, HFConfig
from zeropp.runtime import OptimizerConfig, ZeroConfig


def test_defaults_are_the_main_job() -> None:
    rc = from_dict(composed_config("stage=3", "quant=int8"))
    assert rc.zero == ZeroConfig(stage=3, weights=QuantSpec(bits=8), grad_clip=1.0)
    assert (rc.topology.nodes, rc.topology.ranks_per_node, rc.world_size) == (2, 2, 4)
    assert rc.model == GPTConfig.preset("mini")
    assert rc.trainer.name == "zeropp" and rc.data.kind == "text" and rc.logger.mode == "offline"
    assert rc.optim.schedule == "cosine" and rc.optim.decay_steps == rc.train.steps  # the schedule spans the run
    rc = from_dict(composed_config("quant=zeropp"))
    assert (rc.zero.weights, rc.zero.hpz, rc.zero.grads) == (QuantSpec(bits=8), True, QuantSpec(bits=4))


def test_schema_is_generated_from_the_library() -> None:
    """Every field of every library config is a key, with the library's default (each declared once)."""
    schema = run_schema()
    for section, cls in SECTION_CLASSES.items():
        node = getattr(schema(), section)
        for f in dataclasses.fields(cls):
            if (section, f.name) in (("zero", "stage"), ("topology", "hpz_size")):
                assert not hasattr(node, f.name)  # set through `stage` / zero.hpz_size instead
                continue
            assert hasattr(node, f.name), f"{section}.{f.name}"
    assert dataclasses.fields(ZeroConfig)  # sanity
    for key in (
        "zero.persistence_threshold=64",
        "zero.loss_scale_init=1024",
        "optim.betas=[0.8,0.95]",
        "optim.eps=1e-6",
        "zero.grads.seed=7",
        "zero.weights.rounding=stochastic",
    ):
        check_overrides(["quant=w8g4", key])
    rc = from_dict(
        composed_config(
            "quant=w8g4",
            "zero.persistence_threshold=64",
            "optim.betas=[0.8,0.95]",
            "optim.eps=1e-6",
            "zero.grads.seed=7",
            "zero.grads.intra_bits=8",
            "zero.weights.rounding=stochastic",
            "zero.precision=fp16",
            "zero.loss_scale_init=1024",
        )
    )
    assert rc.zero.persistence_threshold == 64 and rc.optim.betas == (0.8, 0.95) and rc.optim.eps == 1e-6
    assert rc.zero.grads == QuantSpec(bits=4, intra_bits=8, seed=7)
    assert rc.zero.weights == QuantSpec(bits=8, rounding="stochastic") and rc.zero.loss_scale_init == 1024


def test_generated_groups_are_the_library_presets() -> None:
    assert group_options("quant") == sorted(RECIPES)
    for name, recipe in RECIPES.items():
        rc = from_dict(composed_config(f"quant={name}"))
        assert (rc.zero.weights, rc.zero.grads, rc.zero.hpz) == (recipe.weights, recipe.grads, recipe.hpz)
    assert "hf" in group_options("model")
    for name in (n for n in group_options("model") if n != "hf"):
        assert from_dict(composed_config(f"model={name}")).model == GPTConfig.preset(name)
    assert from_dict(composed_config("model=hf")).model == HFConfig()
    rc = from_dict(composed_config("topology=4x2"))
    assert rc.topology == Topology(nodes=4, ranks_per_node=2)


def test_every_option_composes() -> None:
    extra = {"ddp_zeropp": ["quant=qgz"], "fsdp2_zeropp": ["quant=w8g4"]}
    for group in ("quant", "model", "data", "topology", "trainer", "logger", "cluster"):
        for opt in group_options(group):
            from_dict(composed_config(f"{group}={opt}", *(extra.get(opt, []) if group == "trainer" else [])))


@pytest.mark.parametrize(
    "override, words",
    [
        (["stage=5"], ["stage must be", "5"]),
        (["model.vocab_size=100"], ["model.vocab_size=100", "256"]),
        (["quant=int8", "zero.weights.bits=3"], ["zero.weights", "bits=3", "(8, 4)"]),
        (["train.steps=0"], ["train.steps=0", ">= 1"]),
        (["model.n_heads=3"], ["model", "n_heads=3", "d_model"]),
        (["zero.reduce_bucket_size=-1"], ["zero.reduce_bucket_size", "-1"]),
        (["topology.nodes=0"], ["topology.nodes", "positive"]),
        (["quant=int8", "stage=2"], ["stage", "qwZ"]),
        (["quant=int8", "zero.weights.intra_bits=8"], ["zero.weights", "intra_bits"]),
        (["optim.lr=-1"], ["optim.lr", "-1"]),
        (["quant=zeropp", "zero.hpz_size=3"], ["hpz_size", "3"]),
        (["launcher.heartbeat_s=-1"], ["launcher.heartbeat_s=-1.0", "0 (the watch off) or >= 1"]),
        (["launcher.heartbeat_s=0.5"], ["launcher.heartbeat_s=0.5", "0 (the watch off) or >= 1"]),
    ],
)
def test_bad_value_names_key_and_allowed(override: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config(*override))
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "trainer, override",
    [
        ("fsdp2", "zero.prefetch_depth=2"),
        ("fsdp2", "quant=int8"),
        ("fsdp2", "stage=2"),
        ("fsdp2_zeropp", "zero.allgather_bucket_size=1000"),
        ("ddp", "quant=qgz"),
        ("ddp_zeropp", "zero.allgather_bucket_size=10"),
        ("ddp", "zero.persistence_threshold=10"),
        ("fsdp2", "zero.precision=fp16"),
    ],
)
def test_a_key_the_trainer_does_not_use_is_an_error(trainer: str, override: str) -> None:
    extra = ["quant=qgz"] if trainer == "ddp_zeropp" else ["quant=w8g4"] if trainer == "fsdp2_zeropp" else []
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config(f"trainer={trainer}", *extra, override))
    assert trainer in str(e.value) or "fp16" in str(e.value)


def test_trainer_specific_requirements() -> None:
    with pytest.raises(ConfigError, match="ddp_zeropp needs zero.grads"):
        from_dict(composed_config("trainer=ddp_zeropp"))
    with pytest.raises(ConfigError, match="fsdp2_zeropp with nothing quantized"):
        from_dict(composed_config("trainer=fsdp2_zeropp"))
    rc = from_dict(composed_config("trainer=fsdp2", "quant=hpz"))  # hpZ = FSDP2's reshard_after_forward
    assert rc.zero.hpz


def test_bad_topology() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config("topology.nodes=2", "topology.ranks_per_node=0"))
    assert "topology.ranks_per_node" in str(e.value)


def test_command_line_precheck() -> None:
    with pytest.raises(ConfigError) as e:
        check_overrides(["quant=int3"])
    assert "quant='int3'" in str(e.value) and "int8" in str(e.value) and "zeropp" in str(e.value)
    with pytest.raises(ConfigError, match="int9"):
        check_overrides(["-m", "quant=none,int9"])
    with pytest.raises(ConfigError, match="did you mean quant"):
        check_overrides(["quantt=int8"])
    with pytest.raises(ConfigError, match=r"logger='wanb' is not a logger option \(did you mean logger=wandb\?\)"):
        check_overrides(["logger=wanb"])
    with pytest.raises(ConfigError, match=r"train\.stepz.*did you mean train\.steps"):
        check_overrides(["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"zero\.grads\.intra_bitz.*did you mean zero\.grads\.intra_bits"):
        check_overrides(["zero.grads.intra_bitz=8"])
    check_overrides(["stage=3", "quant=w8g4", "train.steps=3", "hydra.run.dir=x", "+foo=1", "zero.grads.bits=8"])
    # a spec field on a recipe that leaves that spec null: say which recipes have it
    with pytest.raises(ConfigError, match=r"zero\.weights\.bits.*quant=none quantizes no weights.*int8"):
        check_overrides(["zero.weights.bits=8"])
    with pytest.raises(ConfigError, match=r"quant=int8 quantizes no grads.*w8g4"):
        check_overrides(["quant=int8", "zero.grads.intra_bits=8"])


def test_cli_errors_exit_2_naming_the_key_without_ranks(tmp_path, monkeypatch, capfd) -> None:
    """Each of :data:`CLI_ERRORS` through the runner's own ``cli()`` (in this process, launching
    replaced by an assertion): exit 2, the words in the error, fast, and no rank started."""
    for i, (args, words) in enumerate(CLI_ERRORS):
        t0 = time.monotonic()
        code, err = run_cli(args, tmp_path / str(i), monkeypatch, capfd)
        assert code == 2, (args, err)
        assert all(w in err for w in words), (args, err)
        assert time.monotonic() - t0 < 30


def test_deleting_a_group_choice_passes_and_a_schema_key_is_refused() -> None:
    """``~quant`` drops a group's choice (Hydra's meaning, allowed); ``~train.steps`` would delete a
    schema key, which always has a value: refused with how to set it instead (no ``null`` offered
    for a key that cannot be null)."""
    check_overrides(["~quant", "~hydra.run.dir", "--config-dir", "~/conf"])
    with pytest.raises(ConfigError, match=r"~train\.steps=5 deletes a key.*set it instead: train\.steps=<value>$"):
        check_overrides(["~train.steps=5"])
    with pytest.raises(ConfigError, match=r"~zero deletes a section.*set its keys instead \(zero\.<key>=<value>\)"):
        check_overrides(["~zero"])


def test_resume_without_a_checkpoint_is_refused_before_ranks(tmp_path, monkeypatch, capfd) -> None:
    """``resume=true`` where no checkpoint was written: exit 2 naming the folder, no rank started."""
    code, err = run_cli(["resume=true", "logger=none", "model=tiny"], tmp_path / "run", monkeypatch, capfd)
    assert code == 2, err
    assert "resume=true but there is no checkpoint under" in err and str(tmp_path / "run") in err, err


def test_resume_of_a_finished_run_is_refused_before_ranks(tmp_path, monkeypatch, capfd) -> None:
    """``resume=true`` where the newest checkpoint is of the last step (or later): exit 2 naming the
    checkpoint's step and ``train.steps``, no rank started; an earlier step passes this check."""
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "ckpt-00000004-0123456789abcdef").mkdir(parents=True)
    (ckpt / "LATEST").write_text("ckpt-00000004-0123456789abcdef\n")
    for steps in (4, 3):
        code, err = run_cli(
            ["resume=true", "logger=none", "model=tiny", f"train.steps={steps}"], tmp_path / "run", monkeypatch, capfd
        )
        assert code == 2, err
        assert f"newest checkpoint in {ckpt} is of step 4 and train.steps={steps}" in err, err
        assert "already finished" in err and "train.steps=8" in err, err
    rc = from_dict(composed_config("resume=true", "train.steps=5"))
    rc.check_run_dir(tmp_path / "run")  # step 4 of 5: there is a step left to train


def test_resume_with_another_model_is_refused_before_ranks(tmp_path, monkeypatch, capfd) -> None:
    """``resume=true`` whose model settings differ from those the checkpoint recorded: exit 2
    naming the keys (before: every rank started and failed on the engine's unit list, or, where the
    shapes agreed, trained the checkpoint under other settings). The attention kernel may change."""
    from tests.checkpoint_helpers import write_version

    ckpt = tmp_path / "run" / "checkpoints"
    d = write_version(ckpt, "ckpt-00000002-0123456789abcdef", parent=None)
    (ckpt / "LATEST").write_text(d.name + "\n")
    saved = from_dict(composed_config("model=hf", "model.lora_rank=0")).to_dict()["model"]
    meta = json.loads((d / "meta.json").read_text()) | {"extra": {"step": 2, "model": saved}}
    (d / "meta.json").write_text(json.dumps(meta))
    code, err = run_cli(
        ["resume=true", "logger=none", "model=hf", "model.lora_rank=4", "train.steps=4"],
        tmp_path / "run",
        monkeypatch,
        capfd,
    )
    assert code == 2, err
    assert f"the checkpoint {d} is of another model: it was saved with model.lora_rank=0 (now 4)" in err, err
    code, err = run_cli(
        ["resume=true", "logger=none", "model=tiny", "train.steps=4"], tmp_path / "run", monkeypatch, capfd
    )
    assert code == 2 and "saved with model.kind='hf' (now 'gpt')." in err, err
    rc = from_dict(composed_config("resume=true", "train.steps=4", "model=hf", "model.attn_implementation=eager"))
    rc.check_run_dir(tmp_path / "run")  # the attention kernel is not the model's shape
    del saved["lora_rank"]  # a checkpoint saved before a model setting existed: not a change
    (d / "meta.json").write_text(json.dumps(meta | {"extra": {"step": 2, "model": saved}}))
    from_dict(composed_config("resume=true", "train.steps=4", "model=hf")).check_run_dir(tmp_path / "run")


def test_resume_at_another_tp_is_refused_before_ranks(tmp_path, monkeypatch, capfd) -> None:
    """An engine checkpoint saved with ``topology.tp=2`` resumed at tp=1 (its pieces load at the
    same tp only): exit 2 naming both (before: every rank started and raised the load's refusal)."""
    from tests.checkpoint_helpers import write_version

    ckpt = tmp_path / "run" / "checkpoints"
    d = write_version(ckpt, "ckpt-00000002-0123456789abcdef", parent=None)
    (ckpt / "LATEST").write_text(d.name + "\n")
    (d / "meta.json").write_text(json.dumps(json.loads((d / "meta.json").read_text()) | {"tp": 2}))
    code, err = run_cli(
        ["resume=true", "logger=none", "model=tiny", "train.steps=4"], tmp_path / "run", monkeypatch, capfd
    )
    assert code == 2, err
    assert f"the checkpoint {d} was saved with topology.tp=2 and this run has topology.tp=1" in err, err
    assert "Resume with topology.tp=2" in err and "export" not in err, err  # (GPT runs have no export)
    from_dict(composed_config("resume=true", "train.steps=4", "topology=1x2", "topology.tp=2")).check_run_dir(
        tmp_path / "run"
    )


def test_resume_from_a_pretrained_directory_that_changed_is_refused(tmp_path) -> None:
    """A Hugging Face run's checkpoint records the transformers config its model was built with;
    a resume whose model.pretrained now holds another config (another norm epsilon), or that drops
    model.pretrained, is refused naming the attribute (before: every rank rebuilt the model from
    the directory as it is now and trained the checkpoint's weights in it, silently)."""
    pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')
    from tests.checkpoint_helpers import write_version
    from zeropp.models import build_hf_model
    from zeropp.models.hf import hf_model_config, recorded_config

    sizes = ["model=hf", "model.hf_config=llama", "model.n_heads=4", "model.d_model=32", "model.n_layers=1"]
    base = from_dict(composed_config(*sizes)).model
    conf = hf_model_config(base)
    conf.rms_norm_eps = 1e-2
    pre = tmp_path / "pre"
    type(build_hf_model(base).hf)(conf).save_pretrained(pre)
    rc = from_dict(composed_config(*sizes, f"model.pretrained={pre}", "resume=true", "train.steps=4"))
    ckpt = tmp_path / "run" / "checkpoints"
    d = write_version(ckpt, "ckpt-00000002-0123456789abcdef", parent=None)
    (ckpt / "LATEST").write_text(d.name + "\n")
    record = {"step": 2, "model": rc.to_dict()["model"], "transformers_config": recorded_config(rc.model)}
    (d / "meta.json").write_text(json.dumps(json.loads((d / "meta.json").read_text()) | {"extra": record}))
    rc.check_run_dir(tmp_path / "run")  # the directory as it was: resumes
    conf.rms_norm_eps = 0.5
    type(build_hf_model(base).hf)(conf).save_pretrained(pre)
    with pytest.raises(
        ConfigError, match=rf"differs from the one model.pretrained={pre} builds: rms_norm_eps=0.01 \(now 0.5\)"
    ):
        rc.check_run_dir(tmp_path / "run")
    bare = from_dict(composed_config(*sizes, "resume=true", "train.steps=4"))
    with pytest.raises(
        ConfigError, match=r"these settings \(no model.pretrained\) builds: .*rms_norm_eps=0.01 \(now 1e-06\)"
    ):
        bare.check_run_dir(tmp_path / "run")


def test_the_runners_hydra_plugins_are_found_outside_the_checkout(tmp_path) -> None:
    """From another directory (an editable install maps ``hydra_plugins.zeropp_*`` through its import
    hook, which Hydra's plugin scan does not list) the runner's sweeper and Slurm launcher are still
    Hydra plugins, and a sweep with an invalid point is refused by that sweeper before any starts."""
    probe = (
        "import zeropp.experiments.runner.run\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.launcher import Launcher\n"
        "from hydra.plugins.sweeper import Sweeper\n"
        "print(*(c.__name__ for c in Plugins.instance().discover(Sweeper) + Plugins.instance().discover(Launcher)))\n"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "ZeroppSweeper" in found.stdout.split(), found.stdout
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:  # the slurm extra
        assert "ZeroppSlurmLauncher" in found.stdout.split(), found.stdout
    p = run_cli_subprocess(
        ["-m", "model=tiny", "logger=none", "zero.reduce_bucket_size=1000,-5", f"hydra.sweep.dir={tmp_path / 's'}"],
        cwd=tmp_path,
    )
    assert p.returncode == 2 and "1 of 2 sweep point(s) cannot run" in p.stderr, p.stderr[-2000:]


def test_omegaconf_entry_and_roundtrip() -> None:
    import zeropp.experiments.runner.run  # noqa: F401

    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        rc = from_omegaconf(compose("config", overrides=["trainer=fsdp2"]))
    assert rc.trainer.name == "fsdp2"
    rc = from_dict(composed_config("quant=zeropp", "zero.grads.rounding=stochastic"))
    assert from_dict(rc.to_dict()) == rc  # what the ranks receive is what was validated


def test_optimizer_schedule_keys() -> None:
    rc = from_dict(composed_config("optim.schedule=constant", "optim.warmup_steps=0"))
    assert rc.optim == OptimizerConfig(lr=3e-3, weight_decay=0.0, schedule="constant", warmup_steps=0)
    with pytest.raises(ConfigError, match="warmup"):
        from_dict(composed_config("optim.warmup_steps=100", "train.steps=10"))


def test_a_group_size_beyond_the_kernels_largest_block_is_a_config_error() -> None:
    """The bound of ``kernels.layout.MAX_GROUP_SIZE`` (one block per GPU program) is met before any
    rank starts, naming the key and the largest allowed; the largest itself is accepted."""
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config("quant=int8", "zero.weights.group_size=32768"))
    assert "zero.weights" in str(e.value) and "group_size <= 16384" in str(e.value), str(e.value)
    assert from_dict(composed_config("quant=int8", "zero.weights.group_size=16384")).zero.weights.group_size == 16384


@pytest.mark.parametrize(
    "override, words",
    [
        (["quant=mxfp4", "zero.grads.group_size=64"], ["zero.grads", "blocks of 32 elements fixed", "group_size=32"]),
        (["quant=nvfp4", "zero.weights.group_size=32"], ["zero.weights", "blocks of 16 elements fixed"]),
        (["quant=int4", "zero.weights.fp8_format=e5m2"], ["zero.weights", "fp8_format=e5m2 does nothing"]),
        (["quant=mxfp4", "zero.grads.fp6_format=e3m2"], ["zero.grads", "fp6_format=e3m2 does nothing", "mx at bits 6"]),
        (["quant=mxfp8", "zero.grads.bits=5"], ["zero.grads", "bits=5", "(8, 6, 4)"]),
    ],
)
def test_format_settings_are_config_errors_before_any_rank(override: list[str], words: list[str]) -> None:
    """A float format's fixed block size and its element choices are checked while the run config is
    built (the runner prints ``error: ...`` and exits 2); a wrong element name is refused by the schema."""
    with pytest.raises(ConfigError) as e:
        from_dict(composed_config(*override))
    for w in words:
        assert w in str(e.value), str(e.value)
    cfg = from_dict(composed_config("quant=w_mxfp8_g_mxfp4", "zero.weights.fp8_format=e5m2"))
    assert cfg.zero.weights.fp8_format == "e5m2" and cfg.zero.grads.hop_bits == (8, 4)


def test_hpz_on_one_node_is_warned_once_before_any_rank(tmp_path, capsys, monkeypatch):
    """``quant=hpz`` (or ``zeropp``, which bundles it) on one node whose hpZ group is the whole node:
    the secondary partition is the primary one over again, a no-op that costs memory. Warned in one
    line, once per process (a sweep's points share it), before any rank starts; not refused, as the
    ``quant=zeropp`` preset and ``sweep=ablation`` bundle it (before: nothing said so). Two nodes, or
    a smaller hpZ group inside the node, are no such no-op: nothing is printed."""
    from zeropp.experiments.runner import preflight

    monkeypatch.setattr(preflight, "_WARNED", set())
    for quant in ("hpz", "zeropp"):
        rc = from_dict(composed_config(f"quant={quant}", "topology=1x2", "stage=3", "data=random"))
        for _ in range(2):
            preflight.check_before_launch(rc, tmp_path, local=False)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "zeropp: warning: zero.hpz=true on one node (topology 1x2): hpZ's secondary partition spans the same 2 "
        "data-parallel rank(s) as the primary one, so it saves no cross-node traffic and only adds its copy's "
        "memory; use topology.nodes >= 2 to measure hpZ, or add zero.hpz=false"
    ]
    # under torchrun every rank runs these checks: rank 0 alone prints the line (before: each rank did)
    rc = from_dict(composed_config("quant=hpz", "topology=1x2", "stage=3", "data=random"))
    for rank in ("1", "0"):
        monkeypatch.setattr(preflight, "_WARNED", set())
        monkeypatch.setenv("RANK", rank)
        preflight.check_before_launch(rc, tmp_path, local=False)
    assert capsys.readouterr().err.splitlines() == err
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(preflight, "_WARNED", set())
    for extra in (["topology=2x2"], ["topology=1x4", "zero.hpz_size=2"], ["quant=none", "topology=1x2"]):
        rc = from_dict(composed_config("quant=hpz", "stage=3", "data=random", *extra))
        preflight.check_before_launch(rc, tmp_path, local=False)
    assert capsys.readouterr().err == ""
