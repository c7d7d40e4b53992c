"""A run's configuration: the library's own config objects plus the harness's few sections.

Each setting is declared once. The ZeRO settings *are* ``zeropp.runtime.ZeroConfig`` (``zero.*``,
with the stage as the top-level ``stage`` key), the optimizer and its LR schedule
``zeropp.runtime.OptimizerConfig`` (``optim.*``), the model ``zeropp.models.GPTConfig`` or, with
``model=hf``, ``zeropp.models.HFConfig`` (``model.*``; ``model.kind`` picks, :data:`MODEL_KINDS`),
the world shape ``zeropp.comm.Topology`` (``topology.*``); quantization is
``zeropp.comm.spec.QuantSpec`` values (``zero.weights.*``, ``zero.grads.*``). Only what no library
object holds is the harness's own: data, trainer, logger, cluster, the training loop and the
launcher, declared in ``sections.py`` (with :class:`ConfigError`; all re-exported here). This
module puts them together (:class:`RunConfig`); ``config_checks.py`` checks them across sections,
``run_dir_checks.py`` the run directory a run starts or resumes in (both re-exported here).
``schema.py`` generates the Hydra schema from all of them.

:func:`from_dict` builds a :class:`RunConfig` from the composed config; every library
``__post_init__`` runs there, before any rank starts, and its objection comes back as a
:class:`ConfigError` naming the key (``zero.grads.bits=3: ...``). Settings that the chosen trainer
would not use, or capabilities it lacks, are refused too (its ``trainer_registry.TrainerSpec``
says which), as are data, logger and cluster keys that the chosen data source, logger or cluster
would not read: nothing is silently ignored. Every float setting of every section must be finite
(:func:`check_finite`). What needs this host (the corpus file, the checkpoint directory, the rank
count and memory) is checked by ``preflight.py``.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Mapping

from zeropp.comm import Topology
from zeropp.comm.choices import plain
from zeropp.models import GPTConfig, HFConfig
from zeropp.runtime import OptimizerConfig, ZeroConfig, checkpoint_files
from zeropp.runtime.config import validate_against_topology

from .checks import MAX_SECONDS, MIN_CORPUS_BYTES, SEED_LIMIT, ConfigError, check
from .config_checks import (
    check_capabilities,
    check_finite,
    check_settings_in_use,
    check_tp,
    check_trainer_keys,
    trainers_that,
)
from .run_dir_checks import (
    RunDirTaken,
    RunFinished,
    RunNeverSaved,
    check_fresh_run_dir,
    check_resumes_its_model,
    check_resumes_its_own,
    run_records,
    saved_by,
)
from .sections import ClusterConfig, DataConfig, LauncherConfig, LoggerConfig, TrainConfig, TrainerConfig
from .slurm import SlurmConfig
from .trainer_registry import TRAINER_SPECS, TrainerSpec, missing_requirement

__all__ = [
    "CONF_DIR",
    "EXCLUDED",
    "MAX_SECONDS",
    "MIN_CORPUS_BYTES",
    "MODEL_KINDS",
    "SECTION_CLASSES",
    "SEED_LIMIT",
    "TOP_LEVEL_FROM",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "LauncherConfig",
    "LoggerConfig",
    "RunConfig",
    "RunDirTaken",
    "RunFinished",
    "RunNeverSaved",
    "SlurmConfig",
    "TrainConfig",
    "TrainerConfig",
    "build_model_config",
    "check_fresh_run_dir",
    "check_resumes_its_own",
    "from_dict",
    "from_omegaconf",
    "interpolation_error",
    "model_field_defaults",
    "run_records",
    "saved_by",
]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The YAML part of the config tree: repo ``conf/`` (installed as ``zeropp.conf``)."""

MODEL_KINDS: dict[str, type] = {"gpt": GPTConfig, "hf": HFConfig}
"""``model.kind`` -> the library class that declares and validates that model's settings: ``gpt``
(the built-in GPT; ``model=<preset>``) or ``hf`` (a Hugging Face GPT-2 / Llama; ``model=hf``, needs
``pip install -e ".[hf]"``). The ``model`` section's keys are the union of their fields; a key of
the other kind set away from its default is refused (:func:`build_model_config`)."""

SECTION_CLASSES: dict[str, type] = {
    "zero": ZeroConfig,
    "optim": OptimizerConfig,
    "model": GPTConfig,
    "topology": Topology,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "launcher": LauncherConfig,
    "slurm": SlurmConfig,
}
"""Config section -> the class that declares and validates it (``model``: the default kind; every
kind is in :data:`MODEL_KINDS`)."""

EXCLUDED: dict[str, tuple[str, ...]] = {"zero": ("stage",), "topology": ("hpz_size",)}
"""Fields set elsewhere: the stage is the top-level ``stage`` key; the hpZ group size is
``zero.hpz_size`` (the engine puts it into the topology)."""

TOP_LEVEL_FROM: dict[str, tuple[str, str]] = {"stage": ("zero", "stage")}
"""Top-level keys that land in a section."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; built through :func:`from_dict` / :func:`from_omegaconf`."""

    zero: ZeroConfig
    optim: OptimizerConfig
    model: GPTConfig | HFConfig
    topology: Topology
    data: DataConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    cluster: ClusterConfig
    train: TrainConfig
    launcher: LauncherConfig
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    """The Slurm jobs of a ``hydra/launcher=slurm`` sweep (``slurm.py``); recorded, not read by the ranks."""
    resume: bool = False
    """Continue from the latest checkpoint in ``train.checkpoint_dir`` (or the run directory's)."""

    def __post_init__(self) -> None:
        spec = TRAINER_SPECS[self.trainer.name]  # TrainerConfig checked the name
        check_trainer_keys(self, spec)
        t = self.topology
        try:
            validate_against_topology(self.zero, t.world_size, t.nodes, t.ranks_per_node)
        except ValueError as e:
            raise ConfigError(f"invalid config (zero.* against topology.*): {e}") from None
        if self.zero.hpz and self.zero.hpz_size is not None:  # the engine builds this topology on every rank
            try:
                dataclasses.replace(t, hpz_size=self.zero.hpz_size)
            except ValueError as e:
                raise ConfigError(
                    f"invalid config (zero.hpz_size={self.zero.hpz_size} against topology.tp={t.tp}): {e}"
                ) from None
        check_capabilities(self, spec)
        check_settings_in_use(self)
        if t.tp > 1:
            check_tp(self)
        if self.data.kind == "text" and self.model.vocab_size < 256:
            raise ConfigError(
                f"invalid config: model.vocab_size={self.model.vocab_size} with data.kind=text; byte "
                "tokens need a vocabulary of at least 256 (or use data=random)"
            )

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def trainer_spec(self) -> TrainerSpec:
        """The registered :class:`TrainerSpec` of ``trainer.name`` (what it honours and is)."""
        return TRAINER_SPECS[self.trainer.name]

    def checkpoint_dir(self, run_dir: Path) -> Path:
        """``train.checkpoint_dir``, or ``<run dir>/checkpoints``."""
        return Path(self.train.checkpoint_dir) if self.train.checkpoint_dir else Path(run_dir) / "checkpoints"

    def check_run_dir(self, run_dir: Path, *, key: str = "hydra.run.dir") -> None:
        """Checked before any rank starts. With ``resume=true``, a checkpoint must be there, of a
        step before ``train.steps`` (a finished run has nothing to continue). Without
        it, the run must not land on an earlier run's records (:func:`check_fresh_run_dir`). ``key``:
        what chooses the directory, named in the refusal (``hydra.sweep.dir`` in a sweep, a tool's
        ``--out``)."""
        ckpt = self.checkpoint_dir(run_dir)
        if self.resume and not (ckpt / "LATEST").is_file():
            saves = self.train.checkpoint_every > 0  # (else nothing of any run could be here)
            kind = RunNeverSaved if saves and not run_records(Path(run_dir)) else ConfigError
            raise kind(
                f"invalid config: resume=true but there is no checkpoint under {ckpt} (no LATEST file); "
                "resume in the directory of a run saved with train.checkpoint_every=N "
                "(hydra.run.dir=<that run>), or point train.checkpoint_dir at its checkpoints"
            )
        if not self.resume:
            check_fresh_run_dir(Path(run_dir), key=key, resumable=(ckpt / "LATEST").is_file())
            return
        try:  # a malformed LATEST or a missing folder: the ranks' load names the problem precisely
            newest = checkpoint_files.latest(ckpt)
            step = checkpoint_files.version_step(newest.name)
        except (OSError, ValueError):
            return
        if step >= self.train.steps:
            raise RunFinished(
                f"invalid config: resume=true, but the newest checkpoint in {ckpt} is of step {step} and "
                f"train.steps={self.train.steps}: that run already finished. To train further raise "
                f"train.steps (e.g. train.steps={2 * step}; the default LR schedule spans train.steps, so "
                "it changes too), or start a fresh run elsewhere"
            )
        check_resumes_its_own(ckpt, Path(run_dir))
        check_resumes_its_model(newest, self.to_dict()["model"], self.model, self.topology.tp)

    def check_installed(self) -> None:
        """The optional packages this run needs are importable (checked before any rank starts):
        ``model=hf`` needs the ``hf`` extra, a trainer its spec's ``requires``; and the weights of
        ``model.pretrained`` are those of the model (``zeropp.models.hf_pretrained``: headers only).
        Not part of validation, so configs compose anywhere."""
        import importlib
        import importlib.util

        missing = missing_requirement(self.trainer_spec)
        if missing:
            raise ConfigError(
                f"invalid config: {missing} (the module {self.trainer_spec.requires!r} is not installed); "
                f"or choose a trainer without it: {trainers_that(lambda s: not s.requires)}"
            )
        if isinstance(self.model, HFConfig):
            if importlib.util.find_spec("transformers") is None:
                raise ConfigError(
                    "invalid config: model=hf needs the Hugging Face extra, which is not installed: "
                    'pip install -e ".[hf]" (or choose a GPT preset: model=mini, ...)'
                )
            try:  # installed but broken: one line here, not the same traceback from every rank
                importlib.import_module("transformers")
            except Exception as e:
                raise ConfigError(
                    f"invalid config: model=hf cannot import transformers ({type(e).__name__}: {e}); repair the "
                    'install (pip install --force-reinstall -e ".[hf]") or choose a GPT preset: model=mini, ...'
                ) from None
            if self.model.pretrained is not None:  # its weights' headers, before every rank reads them
                from zeropp.models.hf import check_pretrained

                try:
                    check_pretrained(self.model)
                except ValueError as e:
                    raise ConfigError(f"invalid config model: {str(e).replace('HFConfig.', 'model.')}") from None
                except ImportError as e:  # installed but broken (found above, fails to import)
                    raise ConfigError(f"invalid config: model=hf cannot import transformers: {e}") from None

    @property
    def model_kind(self) -> str:
        """``model.kind`` of this run (``gpt`` or ``hf``)."""
        return next(k for k, c in MODEL_KINDS.items() if isinstance(self.model, c))

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain JSON/YAML values (fixed choices as their ``str``, not enum members)."""
        d = dataclasses.asdict(self)
        d["model"] = {"kind": self.model_kind, **d["model"]}  # from_dict(to_dict()) rebuilds the same kind
        return plain(d)

    def describe(self, model_name: str | None = None) -> str:
        """A short label: trainer and ZeRO switches, model, precision, topology."""
        z, t = self.zero, self.topology
        if TRAINER_SPECS[self.trainer.name].honours_key("stage"):  # a ZeRO stage of its own
            parts = [f"ZeRO-{z.stage}"]
            parts += [f"qwZ[{z.weights.label}]"] if z.weights else []
            parts += ["hpZ"] if z.hpz else []
            parts += [f"qgZ[{z.grads.label}]"] if z.grads else []
            parts += [f"qWD[{z.weight_diff.label}]"] if z.weight_diff else []
            head = "+".join(parts)
            if not self.trainer_spec.zero_engine:
                head = f"{self.trainer.name} {head}"
        else:
            q = [f"w:{z.weights.label}" if z.weights else "", f"g:{z.grads.label}" if z.grads else ""]
            head = self.trainer.name + (f"({','.join(x for x in q if x)})" if any(q) else "")
        prec = "" if z.precision == "fp32" else f" {z.precision}"
        shape = f"d{self.model.d_model}xL{self.model.n_layers}"
        if isinstance(self.model, HFConfig):
            shape = f"hf-{self.model.hf_config} {shape}"
        return f"{head} {model_name or shape}{prec} {t.nodes}x{t.ranks_per_node}"


def _build(cls: type, values: Mapping[str, Any], key: str) -> Any:
    """``cls(**values)`` with nested dataclasses and tuples rebuilt; errors name ``key``."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown config key {key}.{unknown[0]}; allowed keys of {key}: {', '.join(sorted(names))}")
    kw: dict[str, Any] = {}
    for name, v in values.items():
        tp = hints[name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if isinstance(v, Mapping) and isinstance(inner[0], type) and dataclasses.is_dataclass(inner[0]):
            v = _build(inner[0], v, f"{key}.{name}")
        elif isinstance(v, list):
            v = tuple(v)
        kw[name] = v
        check_finite(f"{key}.{name}", hints[name], v)
    try:
        return cls(**kw)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e).replace(f"{cls.__name__}.", f"{key}.").replace("zero.stage", "stage")
        raise ConfigError(f"invalid config {key}: {msg}") from None


def model_field_defaults() -> dict[str, Any]:
    """Every ``model.*`` key with its default: the kinds' fields, the first kind declaring a name
    giving its default (shared names such as ``d_model`` mean the same in every kind)."""
    out: dict[str, Any] = {}
    for cls in MODEL_KINDS.values():
        for f in dataclasses.fields(cls):
            if f.init and f.name not in out:
                out[f.name] = f.default
    return out


def build_model_config(values: Mapping[str, Any]) -> GPTConfig | HFConfig:
    """The ``model`` section: ``model.kind`` picks the class; its fields build it, and a key that
    only another kind has must be left at its default (nothing is silently ignored)."""
    values = dict(values)
    kind = values.pop("kind", "gpt")
    check(kind in MODEL_KINDS, "model.kind", kind, ", ".join(MODEL_KINDS) + " (model=<GPT preset> or model=hf)")
    cls = MODEL_KINDS[kind]
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    defaults = model_field_defaults()
    for name, v in values.items():
        if name in own:
            continue
        if name not in defaults:
            raise ConfigError(
                f"unknown config key model.{name}; allowed keys of model (model.kind={kind}): "
                f"kind, {', '.join(sorted(own))}"
            )
        if v != defaults[name]:
            other = [k for k, c in MODEL_KINDS.items() if name in {f.name for f in dataclasses.fields(c)}]
            raise ConfigError(
                f"invalid config: model.{name}={v!r} does nothing with model.kind={kind} "
                f"({cls.__name__}); it is a setting of model.kind={'/'.join(other)}. Remove it, or "
                f"choose {'model=hf' if 'hf' in other else 'a GPT preset (model=mini, ...)'}"
            )
    return _build(cls, {k: v for k, v in values.items() if k in own}, "model")


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Validate a plain nested dict (the resolved Hydra config minus ``hydra``)."""
    d = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items() if k not in ("hydra", "sweep")}
    for top, (section, field) in TOP_LEVEL_FROM.items():
        if top in d:
            d.setdefault(section, {})[field] = d.pop(top)
    resume = bool(d.pop("resume", False))
    unknown = [k for k in d if k not in SECTION_CLASSES]
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}; allowed: {', '.join(SECTION_CLASSES)}")
    train = _build(TrainConfig, d.get("train") or {}, "train")
    optim = dict(d.get("optim") or {})
    if optim.get("schedule", "constant") != "constant" and optim.get("decay_steps") is None:
        optim["decay_steps"] = train.steps  # the schedule spans the run unless told otherwise
    d["optim"] = optim
    sections = {name: _build(cls, d.get(name) or {}, name) for name, cls in SECTION_CLASSES.items() if name != "model"}
    sections["model"] = build_model_config(d.get("model") or {})
    return RunConfig(**sections, resume=resume)


def without_hydra(cfg: Any) -> Any:
    """The composed config less its ``hydra`` node (what ``from_omegaconf`` and the runner read)."""
    from omegaconf import OmegaConf

    return OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])


def from_omegaconf(cfg: Any) -> RunConfig:
    """Resolve interpolations and validate the composed Hydra config (the runner's entry, before any
    rank starts: also :meth:`RunConfig.check_installed`)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # a ${...} naming no key, a resolver's bad argument
        raise interpolation_error(e) from None
    rc = from_dict(resolved)  # type: ignore[arg-type]
    rc.check_installed()
    return rc


def interpolation_error(e: Exception, overrides: list[str] | None = None) -> ConfigError:
    """An OmegaConf error met while resolving the composed config (``key=${train.stpes}``: an
    interpolation naming no key) as one ``invalid config`` line naming the key, or the overrides
    holding an interpolation when the key is only Hydra's record of them, and what to change."""
    text = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    key = str(getattr(e, "full_key", "") or "")
    if key and not key.startswith("hydra."):
        where = f"{key}: "
    else:
        held = [o for o in overrides or [] if "${" in o]
        where = f"{' '.join(held)}: " if held else ""
    return ConfigError(
        f"invalid config: {where}{text}; an interpolation must name an existing key (e.g. ${{train.steps}}): "
        "fix or quote the ${...} on the command line"
    )
