"""A run's configuration: the library's own config objects plus the harness's few sections.

Each setting is declared once. The ZeRO settings *are* ``zeropp.runtime.ZeroConfig`` (``zero.*``,
with the stage as the top-level ``stage`` key), the optimizer and its LR schedule
``zeropp.runtime.OptimizerConfig`` (``optim.*``), the model ``zeropp.models.GPTConfig`` or, with
``model=hf``, ``zeropp.models.HFConfig`` (``model.*``; ``model.kind`` picks, :data:`MODEL_KINDS`),
the world shape ``zeropp.comm.Topology`` (``topology.*``); quantization is
``zeropp.comm.spec.QuantSpec`` values (``zero.weights.*``, ``zero.grads.*``). Only what no library
object holds is declared here: data, trainer, logger, cluster, the training loop and the
launcher. ``schema.py`` generates the Hydra schema from all of them.

:func:`from_dict` builds a :class:`RunConfig` from the composed config; every library
``__post_init__`` runs there, before any rank starts, and its objection comes back as a
:class:`ConfigError` naming the key (``zero.grads.bits=3: ...``). Settings that the chosen trainer
would not use are refused too (:data:`HONORED`), as are data, logger and cluster keys that the
chosen data source, logger or cluster would not read: nothing is silently ignored. Every float
setting of every section must be finite (:func:`_check_finite`). What needs this host (the corpus
file, the checkpoint directory, the rank count and memory) is checked by ``preflight.py``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, Mapping

from zeropp.comm import Topology
from zeropp.models import GPTConfig, HFConfig
from zeropp.runtime import OptimizerConfig, ZeroConfig
from zeropp.runtime.config import validate_against_topology

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The YAML part of the config tree: repo ``conf/`` (installed as ``zeropp.conf``)."""

TRAINERS = ("zeropp", "fsdp2", "fsdp2_zeropp", "ddp", "ddp_zeropp")


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and what is allowed."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config: {key}={value!r}; allowed: {allowed}")


def _pos_int(key: str, value: Any, minimum: int = 1) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key, value,
           f"an integer >= {minimum}")


def _unused(key: str, value: Any, default: Any, because: str, fix: str) -> None:
    """A key the chosen setting does not read must stay at its default (nothing is silently ignored)."""
    if value != default:
        raise ConfigError(f"invalid config: {key}={value!r} does nothing with {because}; {fix}")


MIN_CORPUS_BYTES = 4096
"""Fewest corpus bytes a text run accepts (``data.read_corpus`` refuses less)."""

MAX_SECONDS = 1e9
"""Longest time setting (about 31 years): the process group's timeout becomes a ``datetime.timedelta``,
which overflows near 8.6e13 s, so a larger value is a slip that would crash every rank."""

SEED_LIMIT = 2**32
"""``train.seed`` is below this: the data order seeds torch generators with ``seed x 1,000,003 +
rank``, which must stay a 64-bit integer; 2**32 keeps that true for any world size."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. A key the chosen kind/source does not read must stay at its default."""

    kind: str = "text"
    """``text`` (a real corpus read as bytes) or ``random`` (uniform tokens; reads no corpus, so
    ``source``, ``path``, ``max_bytes`` and ``val_fraction`` stay at their defaults)."""
    source: str | None = "python_stdlib"
    """For text: ``python_stdlib`` (this interpreter's own library sources) or ``path``."""
    path: str | None = None
    """For source=path (and only there): a file or a directory read as bytes. The runner reads it
    before any rank starts (``data.check_corpus``)."""
    max_bytes: int = 4_000_000
    """For text: read at most this many bytes of corpus (at least :data:`MIN_CORPUS_BYTES`)."""
    val_fraction: float = 0.05
    """For text: tail of the corpus held out for evaluation, in [0, 0.5). A tail shorter than one
    sequence (0 included) holds nothing out: evaluation then reads the training part."""

    def __post_init__(self) -> None:
        _check(self.kind in ("text", "random"), "data.kind", self.kind, "text, random")
        if self.kind == "random":
            for f in dataclasses.fields(self):
                if f.name != "kind":
                    _unused(f"data.{f.name}", getattr(self, f.name), f.default,
                            "data.kind=random (uniform random tokens, no corpus is read)",
                            "remove it, or use data=text (data.kind=text) to read a corpus")
            return
        _check(self.source in ("python_stdlib", "path"), "data.source", self.source, "python_stdlib, path")
        if self.source == "path":
            _check(isinstance(self.path, str) and bool(self.path.strip()), "data.path", self.path,
                   "a file or directory (data.source=path)")
        else:
            _unused("data.path", self.path, None, f"data.source={self.source}",
                    "add data.source=path to read it, or remove data.path")
        _pos_int("data.max_bytes", self.max_bytes, MIN_CORPUS_BYTES)
        _check(isinstance(self.val_fraction, (int, float)) and 0.0 <= self.val_fraction < 0.5, "data.val_fraction",
               self.val_fraction, "0 <= x < 0.5")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Which training stack runs the model."""

    name: str = "zeropp"
    """zeropp (ZeroEngine), fsdp2, fsdp2_zeropp (FSDP2 + zeropp collectives), ddp, ddp_zeropp
    (DDP + zeropp's quantized all-reduce hook)."""

    def __post_init__(self) -> None:
        _check(self.name in TRAINERS, "trainer", self.name, ", ".join(TRAINERS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """wandb settings (metrics.jsonl and summary.json are always written)."""

    name: str = "wandb"
    """``wandb`` or ``none``."""
    mode: str = "offline"
    """offline (default, no network), online, disabled."""
    project: str = "zeropp"
    """wandb project."""
    entity: str | None = None
    """wandb entity (team/user); None for the default."""
    group: str | None = None
    """wandb group; None: the sweep directory's name in multirun."""
    init_timeout_s: float = 60.0
    """Give up on wandb (with a warning, training goes on) after this many seconds (> 0)."""

    def __post_init__(self) -> None:
        _check(self.name in ("wandb", "none"), "logger.name", self.name, "wandb, none (logger=none)")
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", self.mode, "offline, online, disabled")
        _check(0 < self.init_timeout_s <= MAX_SECONDS, "logger.init_timeout_s", self.init_timeout_s,
               f"> 0 and <= {MAX_SECONDS:g} seconds")
        if self.name == "none":  # no wandb: its settings would be ignored (logger=none sets mode=disabled)
            if self.mode == "online":
                raise ConfigError("invalid config: logger.mode='online' does nothing with logger=none (no wandb); "
                                  "remove it, or use logger=wandb")
            for f in dataclasses.fields(self):
                if f.name not in ("name", "mode"):
                    _unused(f"logger.{f.name}", getattr(self, f.name), f.default, "logger=none (no wandb)",
                            "remove it, or use logger=wandb")

    @property
    def enabled(self) -> bool:
        return self.name == "wandb" and self.mode != "disabled"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the ranks run: this machine (``local``) or the namespace emulator (``emulated``)."""

    name: str = "local"
    """local or emulated."""
    inter_gbps: float = 1.0
    """emulated: shaped rate of each node's uplink, Gbit/s."""
    inter_latency_ms: float = 0.0
    """emulated: added one-way latency of the cross-node link."""

    def __post_init__(self) -> None:
        _check(self.name in ("local", "emulated"), "cluster.name", self.name, "local, emulated")
        _check(self.inter_gbps > 0, "cluster.inter_gbps", self.inter_gbps, "a positive rate")
        _check(self.inter_latency_ms >= 0, "cluster.inter_latency_ms", self.inter_latency_ms, ">= 0")
        if self.name == "local":  # loopback, nothing shaped: the emulator's link settings would be ignored
            for f in dataclasses.fields(self):
                if f.name != "name":
                    _unused(f"cluster.{f.name}", getattr(self, f.name), f.default,
                            "cluster=local (no shaped links)", "add cluster=emulated, or remove it")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop (what no library object holds)."""

    steps: int = 30
    """Optimizer steps of the whole run (a resumed run continues up to this many)."""
    micro_batch_size: int = 8
    """Sequences per rank per micro-batch (``zero.grad_accum_steps`` micro-batches per step)."""
    eval_every: int = 0
    """Evaluate every N steps; 0: only at the end."""
    eval_batches: int = 1
    """Held-out micro-batches each rank evaluates per evaluation; the eval loss is their mean over
    ranks and batches, and every rank reads different ones (rank r takes held-out batches
    r, r + world, ...), so an evaluation covers ``eval_batches x world x micro_batch_size``
    sequences. Raise it where eval-loss differences of a percent matter (``experiments.converge``)."""
    log_every: int = 1
    """Write a metrics line every N steps."""
    seed: int = 0
    """Seed of the model init and the data order, in [0, 2**32) (:data:`SEED_LIMIT`)."""
    throughput_skip_steps: int = 0
    """First steps left out of the throughput and communication averages (compile/warm-up)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (and at the end); 0: never."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None: ``<run dir>/checkpoints``. ``resume=true`` loads the latest one here.
    With ``checkpoint_every > 0`` the runner checks, before any rank starts, that it (or its nearest
    existing parent) is a directory this process can write to."""
    keep_checkpoints: int = 2
    """Good checkpoints kept in ``checkpoint_dir`` (the newest ones); older ones of this run's format
    are deleted after a save succeeds, nothing else in the directory is touched."""
    max_skipped_steps: int = 50
    """fp16 only: this many consecutive steps skipped for overflow (the loss scale could not find a
    finite gradient) stop the run as diverged. With fp32/bf16 a single non-finite loss or gradient
    norm stops it."""
    activation_checkpointing: bool = False
    """ZeRO-R: recompute each block's activations in backward instead of keeping them (torch's
    non-reentrant ``torch.utils.checkpoint`` around every block; at stage 3 the recomputation
    re-gathers the block). Every trainer honours it."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "log_every", "eval_batches", "keep_checkpoints", "max_skipped_steps"):
            _pos_int(f"train.{name}", getattr(self, name))
        for name in ("eval_every", "throughput_skip_steps", "checkpoint_every", "seed"):
            _pos_int(f"train.{name}", getattr(self, name), 0)
        _check(self.throughput_skip_steps < self.steps, "train.throughput_skip_steps", self.throughput_skip_steps,
               f"fewer than train.steps={self.steps}")
        _check(self.seed < SEED_LIMIT, "train.seed", self.seed, "an integer in [0, 2**32)")
        _check(self.checkpoint_dir is None or (isinstance(self.checkpoint_dir, str) and bool(self.checkpoint_dir.strip())),
               "train.checkpoint_dir", self.checkpoint_dir, "a directory path, or null for <run dir>/checkpoints")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """How ranks are started and watched."""

    device: str = "auto"
    """auto (CUDA with NCCL when this host has a GPU per local rank, else CPU with gloo), cpu, cuda."""
    timeout_s: float = 900.0
    """Whole-run limit; ranks are stopped and the run fails past it."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks."""
    pg_timeout_s: float = 120.0
    """Collective timeout of the process group."""
    heartbeat_s: float = 20.0
    """Seconds a rank may be silent (its process stopped, or its main thread making no progress
    while the other ranks are past that point) before the launcher names it and stops the run: at
    least 1, or 0 to turn the watch off (then only ``pg_timeout_s`` and ``timeout_s`` catch a
    silent rank). Not applied under torchrun, whose agent watches its ranks itself."""
    threads_per_rank: int = 1
    """torch intra-op threads per CPU rank."""
    progress: bool = True
    """Progress bar on rank 0."""

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), "launcher.device", self.device, "auto, cpu, cuda")
        _check(0 < self.timeout_s <= MAX_SECONDS, "launcher.timeout_s", self.timeout_s, f"> 0 and <= {MAX_SECONDS:g}")
        _check(0 <= self.grace_s <= MAX_SECONDS, "launcher.grace_s", self.grace_s, f">= 0 and <= {MAX_SECONDS:g}")
        _check(0 < self.pg_timeout_s <= MAX_SECONDS, "launcher.pg_timeout_s", self.pg_timeout_s,
               f"> 0 and <= {MAX_SECONDS:g}")
        _check(self.heartbeat_s == 0 or 1 <= self.heartbeat_s <= MAX_SECONDS, "launcher.heartbeat_s", self.heartbeat_s,
               "0 (the watch off) or >= 1 (seconds; a shorter silence is scheduling noise)")
        _pos_int("launcher.threads_per_rank", self.threads_per_rank)


MODEL_KINDS: dict[str, type] = {"gpt": GPTConfig, "hf": HFConfig}
"""``model.kind`` -> the library class that declares and validates that model's settings: ``gpt``
(the built-in GPT; ``model=<preset>``) or ``hf`` (a Hugging Face GPT-2 / Llama; ``model=hf``, needs
``pip install -e ".[hf]"``). The ``model`` section's keys are the union of their fields; a key of
the other kind set away from its default is refused (:func:`build_model_config`)."""

SECTION_CLASSES: dict[str, type] = {
    "zero": ZeroConfig, "optim": OptimizerConfig, "model": GPTConfig, "topology": Topology,
    "data": DataConfig, "trainer": TrainerConfig, "logger": LoggerConfig, "cluster": ClusterConfig,
    "train": TrainConfig, "launcher": LauncherConfig,
}
"""Config section -> the class that declares and validates it (``model``: the default kind; every
kind is in :data:`MODEL_KINDS`)."""

EXCLUDED: dict[str, tuple[str, ...]] = {"zero": ("stage",), "topology": ("hpz_size",)}
"""Fields set elsewhere: the stage is the top-level ``stage`` key; the hpZ group size is
``zero.hpz_size`` (the engine puts it into the topology)."""

TOP_LEVEL_FROM: dict[str, tuple[str, str]] = {"stage": ("zero", "stage")}
"""Top-level keys that land in a section."""

_COMMON = {"precision", "grad_accum_steps", "grad_clip"}
HONORED: dict[str, set[str] | None] = {
    "zeropp": None,  # everything
    "fsdp2": _COMMON | {"hpz", "hpz_size"},  # hpZ = reshard_after_forward to the hpZ group
    "fsdp2_zeropp": _COMMON | {"hpz", "hpz_size", "weights", "grads"},
    "ddp": _COMMON | {"reduce_bucket_size"},  # DDP's bucket_cap_mb
    "ddp_zeropp": _COMMON | {"reduce_bucket_size", "grads"},
}
"""``zero.*`` fields each trainer uses; setting another one away from its default is an error."""


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
    resume: bool = False
    """Continue from the latest checkpoint in ``train.checkpoint_dir`` (or the run directory's)."""

    def __post_init__(self) -> None:
        _check_trainer_keys(self)
        t = self.topology
        try:
            validate_against_topology(self.zero, t.world_size, t.nodes, t.ranks_per_node)
        except ValueError as e:
            raise ConfigError(f"invalid config (zero.* against topology.*): {e}") from None
        if self.zero.precision == "fp16" and self.trainer.name != "zeropp":
            raise ConfigError(f"invalid config: zero.precision=fp16 with trainer={self.trainer.name}; allowed: "
                              "fp32, bf16 (fp16 loss scaling is implemented by trainer=zeropp)")
        if self.trainer.name == "ddp_zeropp" and self.zero.grads is None:
            raise ConfigError("invalid config: trainer=ddp_zeropp needs zero.grads (its hook quantizes the "
                              "gradient all-reduce); e.g. quant=qgz")
        if self.trainer.name == "fsdp2_zeropp" and self.zero.weights is None and self.zero.grads is None:
            raise ConfigError("invalid config: trainer=fsdp2_zeropp with nothing quantized; choose quant=int8, "
                              "w8g4, ... or trainer=fsdp2")
        if t.tp > 1:
            _check_tp(self)
        if self.data.kind == "text" and self.model.vocab_size < 256:
            raise ConfigError(f"invalid config: model.vocab_size={self.model.vocab_size} with data.kind=text; byte "
                              "tokens need a vocabulary of at least 256 (or use data=random)")

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def checkpoint_dir(self, run_dir: Path) -> Path:
        """``train.checkpoint_dir``, or ``<run dir>/checkpoints``."""
        return Path(self.train.checkpoint_dir) if self.train.checkpoint_dir else Path(run_dir) / "checkpoints"

    def check_resume(self, run_dir: Path) -> None:
        """With ``resume=true``, a checkpoint must be there (checked before any rank starts)."""
        ckpt = self.checkpoint_dir(run_dir)
        if self.resume and not (ckpt / "LATEST").is_file():
            raise ConfigError(f"invalid config: resume=true but there is no checkpoint under {ckpt} (no LATEST file); "
                              "resume in the directory of a run saved with train.checkpoint_every=N "
                              "(hydra.run.dir=<that run>), or point train.checkpoint_dir at its checkpoints")

    def check_installed(self) -> None:
        """The optional packages this run needs are importable (checked before any rank starts):
        ``model=hf`` needs the ``hf`` extra. Not part of validation, so configs compose anywhere."""
        if isinstance(self.model, HFConfig):
            import importlib.util

            if importlib.util.find_spec("transformers") is None:
                raise ConfigError('invalid config: model=hf needs the Hugging Face extra, which is not installed: '
                                  'pip install -e ".[hf]" (or choose a GPT preset: model=mini, ...)')

    @property
    def model_kind(self) -> str:
        """``model.kind`` of this run (``gpt`` or ``hf``)."""
        return next(k for k, c in MODEL_KINDS.items() if isinstance(self.model, c))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = {"kind": self.model_kind, **d["model"]}  # from_dict(to_dict()) rebuilds the same kind
        return d

    def describe(self, model_name: str | None = None) -> str:
        """A short label: trainer and ZeRO switches, model, precision, topology."""
        z, t = self.zero, self.topology
        if self.trainer.name == "zeropp":
            parts = [f"ZeRO-{z.stage}"]
            parts += [f"qwZ[{z.weights.label}]"] if z.weights else []
            parts += ["hpZ"] if z.hpz else []
            parts += [f"qgZ[{z.grads.label}]"] if z.grads else []
            parts += [f"qWD[{z.weight_diff.label}]"] if z.weight_diff else []
            head = "+".join(parts)
        else:
            q = [f"w:{z.weights.label}" if z.weights else "", f"g:{z.grads.label}" if z.grads else ""]
            head = self.trainer.name + (f"({','.join(x for x in q if x)})" if any(q) else "")
        prec = "" if z.precision == "fp32" else f" {z.precision}"
        shape = f"d{self.model.d_model}xL{self.model.n_layers}"
        if isinstance(self.model, HFConfig):
            shape = f"hf-{self.model.hf_config} {shape}"
        return f"{head} {model_name or shape}{prec} {t.nodes}x{t.ranks_per_node}"


def _check_tp(rc: RunConfig) -> None:
    """``topology.tp > 1``: only the zeropp trainer splits models; the model's heads and widths must
    divide (checkpoints of a split model load at the same tp, which ``ZeroEngine.load_checkpoint`` checks)."""
    tp = rc.topology.tp
    if rc.trainer.name != "zeropp":
        raise ConfigError(f"invalid config: topology.tp={tp} with trainer={rc.trainer.name}; tensor parallelism is "
                          "implemented by trainer=zeropp only (or set topology.tp=1)")
    from zeropp.models.gpt import check_gpt_tp
    from zeropp.models.hf import check_hf_tp

    try:
        (check_hf_tp if isinstance(rc.model, HFConfig) else check_gpt_tp)(rc.model, tp)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None


def _check_trainer_keys(rc: RunConfig) -> None:
    name = rc.trainer.name
    honored = HONORED[name]
    if honored is None:
        return
    default = ZeroConfig()
    if rc.zero.stage != default.stage:
        raise ConfigError(f"invalid config: stage={rc.zero.stage} does nothing with trainer={name} "
                          f"({'FSDP2 is always ZeRO-3' if name.startswith('fsdp2') else 'DDP replicates everything'}); "
                          "stages 0-2 are trainer=zeropp")
    for f in dataclasses.fields(ZeroConfig):
        if f.name == "stage" or f.name in honored:
            continue
        if getattr(rc.zero, f.name) != getattr(default, f.name):
            raise ConfigError(f"invalid config: zero.{f.name}={getattr(rc.zero, f.name)!r} does nothing with "
                              f"trainer={name}; it uses only zero.{{{', '.join(sorted(honored))}}}. Remove it, or use "
                              "trainer=zeropp" + (" / trainer=fsdp2_zeropp" if f.name == "weights" else ""))


def _mentions_float(tp: Any) -> bool:
    """True when a field annotation holds floats (``float``, ``float | None``, ``tuple[float, ...]``)."""
    return tp is float or any(_mentions_float(a) for a in typing.get_args(tp))


def _check_finite(key: str, tp: Any, value: Any) -> None:
    """Every float setting of every section is finite: no setting means anything at inf or nan
    (a rate, a timeout, a learning rate, a loss scale), and where "off" exists it is ``null``.
    One check for every section, library ones included, so a new float field is covered too."""
    if not _mentions_float(tp):
        return
    for x in value if isinstance(value, tuple) else (value,):
        if isinstance(x, float) and not math.isfinite(x):
            raise ConfigError(f"invalid config: {key}={value!r}; allowed: a finite number (inf and nan are not settings)")


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
        if isinstance(v, Mapping) and dataclasses.is_dataclass(inner[0]):
            v = _build(inner[0], v, f"{key}.{name}")
        elif isinstance(v, list):
            v = tuple(v)
        kw[name] = v
        _check_finite(f"{key}.{name}", hints[name], v)
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
    _check(kind in MODEL_KINDS, "model.kind", kind, ", ".join(MODEL_KINDS) + " (model=<GPT preset> or model=hf)")
    cls = MODEL_KINDS[kind]
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    defaults = model_field_defaults()
    for name, v in values.items():
        if name in own:
            continue
        if name not in defaults:
            raise ConfigError(f"unknown config key model.{name}; allowed keys of model (model.kind={kind}): "
                              f"kind, {', '.join(sorted(own))}")
        if v != defaults[name]:
            other = [k for k, c in MODEL_KINDS.items() if name in {f.name for f in dataclasses.fields(c)}]
            raise ConfigError(f"invalid config: model.{name}={v!r} does nothing with model.kind={kind} "
                              f"({cls.__name__}); it is a setting of model.kind={'/'.join(other)}. Remove it, or "
                              f"choose {'model=hf' if 'hf' in other else 'a GPT preset (model=mini, ...)'}")
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


def from_omegaconf(cfg: Any) -> RunConfig:
    """Resolve interpolations and validate the composed Hydra config (the runner's entry, before any
    rank starts: also :meth:`RunConfig.check_installed`)."""
    from omegaconf import OmegaConf

    rc = from_dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    rc.check_installed()
    return rc
