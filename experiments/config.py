"""A validated, typed view of the composed Hydra config.

Hydra composes ``conf/`` into a loose ``DictConfig``; everything downstream (launcher, ranks,
report, wandb) reads :class:`RunConfig`, a tree of frozen dataclasses built by
:func:`from_omegaconf`. Building it checks every value, so a bad override fails *before* any rank
starts, with a message that names the full key, the bad value and the allowed values. The
dataclasses are plain and picklable: the launcher writes them to JSON for the ranks, and
``summary.json`` records them.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Mapping

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The config tree: repo ``conf/`` (installed as ``zeropp.conf``)."""


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and what is allowed."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config: {key}={value!r}; allowed: {allowed}")


def _bits(key: str, value: Any) -> int | None:
    _check(value is None or value in (4, 8), key, value, "8, 4 or null (no quantization)")
    return value


def _pos_int(key: str, value: Any, minimum: int = 1) -> int:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key, value,
           f"an integer >= {minimum}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroSection:
    """ZeRO stage (top-level ``stage`` key) and the ZeRO++ switches (``quant/`` group); names follow
    ``zeropp.runtime.ZeroConfig``, which also validates them (see :func:`check_zero_runtime`)."""

    stage: int
    """0 (DP), 1 (optimizer states sharded), 2 (+gradients), 3 (+parameters)."""
    qwz_bits: int | None = None
    """qwZ: bits of the stage-3 weight all-gather (8, 4), None for full precision."""
    qwz_group_size: int | None = None
    """Elements per weight scale block; None: kernel default (512)."""
    qwz_stochastic: bool = False
    """Round the qwZ weight gather stochastically (unbiased) instead of to nearest; needs qwz_bits."""
    hpz: bool = False
    """hpZ: secondary intra-node weight shard, so the backward all-gather stays inside the node."""
    hpz_size: int | None = None
    """Ranks of a hpZ group (a divisor of ranks_per_node); None: the whole node."""
    qgz_bits: int | None = None
    """qgZ: bits of the cross-node hop of the gradient reduce-scatter (8, 4), None for full precision."""
    qgz_intra_bits: int | None = None
    """Bits of qgZ's intra-node hop; None: same as qgz_bits."""
    qgz_group_size: int | None = None
    """Elements per gradient scale block; None: kernel default (128)."""
    qgz_error_feedback: bool = False
    """Carry each gradient reduce-scatter's quantization error into the next one."""
    qgz_stochastic: bool = False
    """Round qgZ's gradient quantizations stochastically (unbiased) instead of to nearest; needs qgz_bits."""
    reduce_bucket_size: int = 500_000_000
    """Most elements one gradient collective moves."""
    allgather_bucket_size: int = 500_000_000
    """Most elements one parameter all-gather moves."""
    prefetch_depth: int = 1
    """Stage 3: blocks gathered ahead of the one computing (0: gather when needed)."""

    def __post_init__(self) -> None:
        _check(self.stage in (0, 1, 2, 3), "stage", self.stage, "0, 1, 2, 3")
        for name in ("qwz_bits", "qgz_bits", "qgz_intra_bits"):
            _bits(f"zero.{name}", getattr(self, name))
        for name in ("hpz", "qgz_error_feedback", "qwz_stochastic", "qgz_stochastic"):
            _check(isinstance(getattr(self, name), bool), f"zero.{name}", getattr(self, name), "true, false")
        for name, bits in (("qwz_stochastic", "qwz_bits"), ("qgz_stochastic", "qgz_bits")):
            _check(not getattr(self, name) or getattr(self, bits) is not None, f"zero.{name}", getattr(self, name),
                   f"false unless zero.{bits} is set (it rounds quantized values; e.g. quant=zeropp)")
        for name in ("qwz_group_size", "qgz_group_size", "hpz_size"):
            v = getattr(self, name)
            if v is not None:
                _pos_int(f"zero.{name}", v)
        for name in ("qwz_group_size", "qgz_group_size"):
            v = getattr(self, name)
            _check(v is None or v % 2 == 0, f"zero.{name}", v, "an even integer or null (INT4 packs two codes per byte)")
        _pos_int("zero.reduce_bucket_size", self.reduce_bucket_size)
        _pos_int("zero.allgather_bucket_size", self.allgather_bucket_size)
        _pos_int("zero.prefetch_depth", self.prefetch_depth, 0)

    def effective(self) -> "ZeroSection":
        """The switches that apply at this stage: qwZ and hpZ need sharded weights (stage 3), qgZ
        a reduce-scatter (stage >= 1).

        A grid such as ``stage=0,1,2,3 quant=none,int8`` therefore runs at every point; the
        summary records the effective switches next to the requested ones.
        """
        eff = self
        if self.stage < 3:
            eff = dataclasses.replace(eff, qwz_bits=None, qwz_group_size=None, qwz_stochastic=False, hpz=False,
                                      hpz_size=None)
        if self.stage == 0:
            eff = dataclasses.replace(eff, qgz_bits=None, qgz_intra_bits=None, qgz_group_size=None,
                                      qgz_error_feedback=False, qgz_stochastic=False)
        return eff

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        eff = self.effective()
        if eff.qwz_bits:
            parts.append(f"qwZ{eff.qwz_bits}")
        if eff.hpz:
            parts.append("hpZ")
        if eff.qgz_bits:
            parts.append(f"qgZ{eff.qgz_bits}")
        return "+".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """GPT shape; names follow ``zeropp.models.GPTConfig`` (byte-level vocabulary of 256)."""

    name: str
    """Preset name, for labels."""
    n_layers: int
    """Transformer blocks (ZeRO-3's gather units)."""
    n_heads: int
    """Attention heads; must divide d_model."""
    d_model: int
    """Residual stream width."""
    seq_len: int
    """Context length, also the training sequence length."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""
    vocab_size: int = 256
    """Byte-level vocabulary."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "d_model", "seq_len", "mlp_ratio", "vocab_size"):
            _pos_int(f"model.{name}", getattr(self, name))
        _check(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
               f"a divisor of model.d_model={self.d_model}")
        _check(self.vocab_size >= 256, "model.vocab_size", self.vocab_size, ">= 256 (byte tokens)")

    def num_params(self) -> int:
        """Parameter count of zeropp's GPT layout (untied head, biases, LayerNorms)."""
        d, h = self.d_model, self.d_model * self.mlp_ratio
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d + d * self.vocab_size + self.vocab_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Where tokens come from."""

    kind: str
    """``text`` (a real corpus read as bytes) or ``random`` (uniform tokens)."""
    source: str | None = None
    """For text: ``python_stdlib`` (this interpreter's own library sources) or ``path``."""
    path: str | None = None
    """For source=path: a file or a directory read as bytes."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of corpus."""
    val_fraction: float = 0.05
    """Tail of the corpus held out for evaluation."""

    def __post_init__(self) -> None:
        _check(self.kind in ("text", "random"), "data.kind", self.kind, "text, random")
        if self.kind == "text":
            _check(self.source in ("python_stdlib", "path"), "data.source", self.source, "python_stdlib, path")
            if self.source == "path":
                _check(bool(self.path), "data.path", self.path, "a file or directory (data.source=path)")
            _pos_int("data.max_bytes", self.max_bytes, 1024)
        _check(0.0 <= self.val_fraction < 0.5, "data.val_fraction", self.val_fraction, "0 <= x < 0.5")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologySection:
    """How many ranks and how they group into (possibly emulated) nodes."""

    world_size: int
    """Total ranks."""
    ranks_per_node: int
    """Ranks sharing a node (fast links); world_size must be a multiple."""

    def __post_init__(self) -> None:
        _pos_int("topology.world_size", self.world_size)
        _pos_int("topology.ranks_per_node", self.ranks_per_node)
        if self.world_size % self.ranks_per_node:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ConfigError(
                f"invalid config: topology.ranks_per_node={self.ranks_per_node} does not divide "
                f"topology.world_size={self.world_size}; allowed ranks_per_node: {divisors}"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def zeropp(self) -> Any:
        """This shape as a ``zeropp.comm.Topology`` (no collective; node_of, same_node, ...)."""
        from zeropp.comm import Topology

        return Topology(nodes=self.nodes, ranks_per_node=self.ranks_per_node)


TRAINERS = ("zeropp", "fsdp2", "fsdp2_zeropp", "ddp", "ddp_zeropp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSection:
    """Which training stack runs the model."""

    name: str
    """zeropp (ZeroEngine), fsdp2, fsdp2_zeropp (FSDP2 + zeropp collectives), ddp, ddp_zeropp."""
    reshard_after_forward: bool | int = True
    """FSDP2 only: True, False, or a group size to reshard to after forward (FSDP2's hpZ)."""

    def __post_init__(self) -> None:
        _check(self.name in TRAINERS, "trainer.name", self.name, ", ".join(TRAINERS))
        raf = self.reshard_after_forward
        _check(isinstance(raf, bool) or (isinstance(raf, int) and raf >= 1),
               "trainer.reshard_after_forward", raf, "true, false or a positive int")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggerSection:
    """wandb settings (metrics.jsonl and summary.json are always written)."""

    name: str
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
    """Give up on wandb (with a warning, training goes on) after this long."""

    def __post_init__(self) -> None:
        _check(self.name in ("wandb", "none"), "logger.name", self.name, "wandb, none (logger=none)")
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", self.mode, "offline, online, disabled")

    @property
    def enabled(self) -> bool:
        return self.name == "wandb" and self.mode != "disabled"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSection:
    """Where the ranks run: this machine (``local``) or the namespace emulator (``emulated``)."""

    name: str
    """local or emulated."""
    inter_gbps: float = 1.0
    """emulated: shaped rate of each node's uplink, Gbit/s."""
    inter_latency_ms: float = 0.0
    """emulated: added one-way latency of the cross-node link."""

    def __post_init__(self) -> None:
        _check(self.name in ("local", "emulated"), "cluster.name", self.name, "local, emulated")
        _check(self.inter_gbps > 0, "cluster.inter_gbps", self.inter_gbps, "a positive rate")
        _check(self.inter_latency_ms >= 0, "cluster.inter_latency_ms", self.inter_latency_ms, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
    """The training loop."""

    steps: int
    """Optimizer steps."""
    micro_batch_size: int
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip; 0 disables."""
    warmup_steps: int = 0
    """First steps left out of the throughput averages."""
    eval_every: int = 0
    """Evaluate every N steps; 0: only at the end."""
    log_every: int = 1
    """Write a metrics line every N steps."""
    seed: int = 0
    """Seed of the model init and the data order."""
    precision: str = "fp32"
    """Compute/communication dtype: fp32, bf16, or fp16 (trainer=zeropp only, dynamic loss scaling)."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "grad_accum", "log_every"):
            _pos_int(f"train.{name}", getattr(self, name))
        _pos_int("train.warmup_steps", self.warmup_steps, 0)
        _pos_int("train.eval_every", self.eval_every, 0)
        _check(self.warmup_steps < self.steps, "train.warmup_steps", self.warmup_steps,
               f"fewer than train.steps={self.steps}")
        _check(self.lr > 0, "train.lr", self.lr, "a positive float")
        _check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, ">= 0 (0 disables)")
        _check(self.precision in ("fp32", "bf16", "fp16"), "train.precision", self.precision, "fp32, bf16, fp16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherSection:
    """How ranks are started and watched."""

    device: str = "auto"
    """auto (CUDA with NCCL when there are enough GPUs, else CPU with gloo), cpu, cuda."""
    timeout_s: float = 900.0
    """Whole-run limit; ranks are stopped and the run fails past it."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks."""
    pg_timeout_s: float = 120.0
    """Collective timeout of the process group."""
    threads_per_rank: int = 1
    """torch intra-op threads per CPU rank."""
    progress: bool = True
    """Text progress bar on rank 0."""

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), "launcher.device", self.device, "auto, cpu, cuda")
        _check(self.timeout_s > 0, "launcher.timeout_s", self.timeout_s, "> 0")
        _check(self.grace_s >= 0, "launcher.grace_s", self.grace_s, ">= 0")
        _check(self.pg_timeout_s > 0, "launcher.pg_timeout_s", self.pg_timeout_s, "> 0")
        _pos_int("launcher.threads_per_rank", self.threads_per_rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; built only through :func:`from_omegaconf` / :func:`from_dict`."""

    zero: ZeroSection
    model: ModelSection
    data: DataSection
    topology: TopologySection
    trainer: TrainerSection
    logger: LoggerSection
    cluster: ClusterSection
    train: TrainSection
    launcher: LauncherSection

    def __post_init__(self) -> None:
        if self.train.precision == "fp16" and self.trainer.name != "zeropp":
            raise ConfigError(f"invalid config: train.precision='fp16' with trainer={self.trainer.name}; "
                              "allowed: fp32, bf16 (fp16 loss scaling is implemented by trainer=zeropp)")
        if self.trainer.name == "ddp_zeropp":
            _check(self.zero.qgz_bits is not None, "zero.qgz_bits", self.zero.qgz_bits,
                   "8 or 4 with trainer=ddp_zeropp (its hook quantizes gradients; e.g. quant=qgz)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """A short label: trainer, ZeRO switches, topology."""
        t = self.topology
        z = self.zero.label if self.trainer.name == "zeropp" else self.trainer.name
        if self.trainer.name in ("fsdp2_zeropp", "ddp_zeropp"):
            q = [f"w{self.zero.qwz_bits}" if self.zero.qwz_bits and self.trainer.name == "fsdp2_zeropp" else "",
                 f"g{self.zero.qgz_bits}" if self.zero.qgz_bits else ""]
            z += "(" + "".join(q) + ")" if any(q) else ""
        prec = "" if self.train.precision == "fp32" else f" {self.train.precision}"
        return f"{z} {self.model.name}{prec} {t.nodes}x{t.ranks_per_node}"


SECTIONS = {
    "zero": ZeroSection, "model": ModelSection, "data": DataSection, "topology": TopologySection,
    "trainer": TrainerSection, "logger": LoggerSection, "cluster": ClusterSection,
    "train": TrainSection, "launcher": LauncherSection,
}


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in fields]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(k, fields, n=1)
        hint = f" (did you mean {name}.{near[0]}?)" if near else ""
        raise ConfigError(f"unknown config key {name}.{k}{hint}; allowed keys of {name}: {', '.join(fields)}")
    required = [f for f, spec in fields.items()
                if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]
    missing = [f for f in required if f not in values]
    if missing:
        raise ConfigError(f"missing config key {name}.{missing[0]}")
    return cls(**dict(values))


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Validate a plain nested dict (the resolved Hydra config minus ``hydra``)."""
    d = {k: v for k, v in d.items() if k not in ("hydra", "sweep")}
    if "stage" in d:  # the top-level key the command line uses (stage=3) belongs to the zero section
        d["zero"] = {**(d.get("zero") or {}), "stage": d.pop("stage")}
    unknown = [k for k in d if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}; allowed: {', '.join(SECTIONS)}")
    missing = [k for k in SECTIONS if k not in d]
    if missing:
        raise ConfigError(f"config section {missing[0]!r} is missing")
    return RunConfig(**{k: _build_section(k, cls, d[k] or {}) for k, cls in SECTIONS.items()})


def from_omegaconf(cfg: Any) -> RunConfig:
    """Resolve interpolations and validate the composed Hydra config."""
    from omegaconf import OmegaConf

    return from_dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def check_zero_runtime(rc: RunConfig) -> None:
    """Let ``zeropp.runtime`` check the ZeRO switches too (e.g. hpz_size vs ranks per node), so its
    objections also surface before any rank starts, as a :class:`ConfigError`."""
    if rc.trainer.name != "zeropp":
        return
    try:
        from zeropp.runtime.config import validate_against_topology

        from .trainers import zero_config
    except ImportError:  # runtime not installed: the ranks will say so
        return
    try:
        zc = zero_config(rc)
        t = rc.topology
        validate_against_topology(zc, t.world_size, t.nodes, t.ranks_per_node)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid config (zero.*, checked by zeropp.runtime): {e}") from None
