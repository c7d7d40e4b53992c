"""The harness's own config sections: what no library object holds.

``data``, ``trainer``, ``logger``, ``cluster``, ``train`` and ``launcher`` (:class:`DataConfig`,
:class:`TrainerConfig`, :class:`LoggerConfig`, :class:`ClusterConfig`, :class:`TrainConfig`,
:class:`LauncherConfig`), each a frozen dataclass validated in ``__post_init__`` with the
checks of ``checks.py`` (:class:`ConfigError`, :func:`check`, :func:`pos_int`,
:func:`unused`). How they combine with the library's sections into one run's config, and the
checks across sections, is ``config.py``, which re-exports everything here.
"""

from __future__ import annotations

import dataclasses

from ..cluster.emulator import MAX_GBPS, MAX_LATENCY_MS, MIN_GBPS
from .checks import (
    MAX_SECONDS,
    MIN_CORPUS_BYTES,
    SEED_LIMIT,
    ClusterName,
    ConfigError,
    DataKind,
    DataSource,
    LauncherDevice,
    LoggerMode,
    LoggerName,
    check,
    choice,
    pos_int,
    unused,
)
from .trainer_registry import TRAINER_SPECS

__all__ = ["ClusterConfig", "DataConfig", "LauncherConfig", "LoggerConfig", "TrainConfig", "TrainerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. A key the chosen kind/source does not read must stay at its default."""

    kind: DataKind = DataKind.text
    """``text`` (a real corpus read as bytes) or ``random`` (uniform tokens; reads no corpus, so
    ``source``, ``path``, ``max_bytes`` and ``val_fraction`` stay at their defaults)."""
    source: DataSource | None = DataSource.python_stdlib
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
        choice(self, "kind", DataKind, "data.kind")
        if self.kind == "random":
            for f in dataclasses.fields(self):
                if f.name != "kind":
                    unused(
                        f"data.{f.name}",
                        getattr(self, f.name),
                        f.default,
                        "data.kind=random (uniform random tokens, no corpus is read)",
                        "remove it, or use data=text (data.kind=text) to read a corpus",
                    )
            return
        choice(self, "source", DataSource, "data.source")
        if self.source == "path":
            check(
                isinstance(self.path, str) and bool(self.path.strip()),
                "data.path",
                self.path,
                "a file or directory (data.source=path)",
            )
        else:
            unused(
                "data.path",
                self.path,
                None,
                f"data.source={self.source}",
                "add data.source=path to read it, or remove data.path",
            )
        pos_int("data.max_bytes", self.max_bytes, MIN_CORPUS_BYTES)
        check(
            isinstance(self.val_fraction, (int, float)) and 0.0 <= self.val_fraction < 0.5,
            "data.val_fraction",
            self.val_fraction,
            "0 <= x < 0.5",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Which training stack runs the model."""

    name: str = "zeropp"
    """A registered trainer (``trainer_registry.TRAINER_SPECS``): zeropp (ZeroEngine), fsdp2,
    fsdp2_zeropp (FSDP2 + zeropp collectives), ddp, ddp_zeropp (DDP + zeropp's quantized
    all-reduce hook), or one added with ``register_trainer``."""

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and self.name in TRAINER_SPECS, "trainer", self.name, ", ".join(TRAINER_SPECS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """wandb settings (metrics.jsonl and summary.json are always written)."""

    name: LoggerName = LoggerName.wandb
    """``wandb`` or ``none``."""
    mode: LoggerMode = LoggerMode.offline
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
        choice(self, "name", LoggerName, "logger.name", "wandb, none (logger=none)")
        choice(self, "mode", LoggerMode, "logger.mode")
        check(
            0 < self.init_timeout_s <= MAX_SECONDS,
            "logger.init_timeout_s",
            self.init_timeout_s,
            f"> 0 and <= {MAX_SECONDS:g} seconds",
        )
        if self.name == "none":  # no wandb: its settings would be ignored (logger=none sets mode=disabled)
            if self.mode == "online":
                raise ConfigError(
                    "invalid config: logger.mode='online' does nothing with logger=none (no wandb); "
                    "remove it, or use logger=wandb"
                )
            for f in dataclasses.fields(self):
                if f.name not in ("name", "mode"):
                    unused(
                        f"logger.{f.name}",
                        getattr(self, f.name),
                        f.default,
                        "logger=none (no wandb)",
                        "remove it, or use logger=wandb",
                    )

    @property
    def enabled(self) -> bool:
        return self.name == "wandb" and self.mode != "disabled"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the ranks run: this machine (``local``) or the namespace emulator (``emulated``)."""

    name: ClusterName = ClusterName.local
    """local or emulated."""
    inter_gbps: float = 1.0
    """emulated: shaped rate of each node's uplink, Gbit/s."""
    inter_latency_ms: float = 0.0
    """emulated: added one-way latency of the cross-node link."""

    def __post_init__(self) -> None:
        choice(self, "name", ClusterName, "cluster.name")
        check(self.inter_gbps > 0, "cluster.inter_gbps", self.inter_gbps, "a positive rate")
        check(self.inter_latency_ms >= 0, "cluster.inter_latency_ms", self.inter_latency_ms, ">= 0")
        if self.name == "emulated":  # what tc can shape: a unit slip (1e9 for 1 Gbit/s) is refused here, not by tc
            check(
                MIN_GBPS <= self.inter_gbps <= MAX_GBPS,
                "cluster.inter_gbps",
                self.inter_gbps,
                f"Gbit/s from {MIN_GBPS:g} to {MAX_GBPS:g}, what the emulator shapes (1 Gbit/s is 1, not 1e9)",
            )
            check(
                self.inter_latency_ms <= MAX_LATENCY_MS,
                "cluster.inter_latency_ms",
                self.inter_latency_ms,
                f"one-way ms from 0 to {MAX_LATENCY_MS:g}",
            )
        if self.name == "local":  # loopback, nothing shaped: the emulator's link settings would be ignored
            for f in dataclasses.fields(self):
                if f.name != "name":
                    unused(
                        f"cluster.{f.name}",
                        getattr(self, f.name),
                        f.default,
                        "cluster=local (no shaped links)",
                        "add cluster=emulated, or remove it",
                    )


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
    sequences. Raise it where eval-loss differences of a percent matter (``experiments.studies.converge``)."""
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
    profile: bool = False
    """Record ``train.profile_steps`` with ``torch.profiler`` (CPU activities, and CUDA ones on a GPU;
    every thread, so the comm worker's qgZ hops too) and write one Chrome trace per rank and step,
    ``<run dir>/profile/rank<r>_step<n>.json`` (Perfetto opens it; zeropp's collectives are named
    ranges, ``zeropp.comm.ranges``). ``python -m experiments.plan <run dir>`` puts a profiled step
    beside its projection."""
    profile_steps: tuple[int, ...] = ()
    """Steps to profile (1-based, within ``1..train.steps``), e.g. ``[3,4]``; empty: the last step.
    Each is recorded after one unrecorded warm-up step of the profiler. Needs ``train.profile=true``."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "log_every", "eval_batches", "keep_checkpoints", "max_skipped_steps"):
            pos_int(f"train.{name}", getattr(self, name))
        for name in ("eval_every", "throughput_skip_steps", "checkpoint_every", "seed"):
            pos_int(f"train.{name}", getattr(self, name), 0)
        check(
            self.throughput_skip_steps < self.steps,
            "train.throughput_skip_steps",
            self.throughput_skip_steps,
            f"fewer than train.steps={self.steps}",
        )
        check(self.seed < SEED_LIMIT, "train.seed", self.seed, "an integer in [0, 2**32)")
        check(
            self.checkpoint_dir is None or (isinstance(self.checkpoint_dir, str) and bool(self.checkpoint_dir.strip())),
            "train.checkpoint_dir",
            self.checkpoint_dir,
            "a directory path, or null for <run dir>/checkpoints",
        )
        self._check_profile()

    def _check_profile(self) -> None:
        steps = self.profile_steps
        if isinstance(steps, list):  # as OmegaConf hands it over
            object.__setattr__(self, "profile_steps", steps := tuple(steps))
        check(isinstance(self.profile, bool), "train.profile", self.profile, "true, false")
        check(
            isinstance(steps, tuple) and all(isinstance(s, int) and not isinstance(s, bool) for s in steps),
            "train.profile_steps",
            steps,
            "a list of step numbers, e.g. [3,4]",
        )
        if not self.profile:
            unused(
                "train.profile_steps",
                list(steps),
                [],
                "train.profile=false",
                "set train.profile=true to profile those steps, or remove train.profile_steps",
            )
        check(
            all(1 <= s <= self.steps for s in steps) and len(set(steps)) == len(steps),
            "train.profile_steps",
            list(steps),
            f"distinct steps within the run, each in 1..train.steps={self.steps}",
        )

    @property
    def profiled_steps(self) -> tuple[int, ...]:
        """The steps ``train.profile`` records, in order (``profile_steps``, or the last step)."""
        if not self.profile:
            return ()
        return tuple(sorted(self.profile_steps)) or (self.steps,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """How ranks are started and watched."""

    device: LauncherDevice = LauncherDevice.auto
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
        choice(self, "device", LauncherDevice, "launcher.device")
        check(0 < self.timeout_s <= MAX_SECONDS, "launcher.timeout_s", self.timeout_s, f"> 0 and <= {MAX_SECONDS:g}")
        check(0 <= self.grace_s <= MAX_SECONDS, "launcher.grace_s", self.grace_s, f">= 0 and <= {MAX_SECONDS:g}")
        check(
            0 < self.pg_timeout_s <= MAX_SECONDS,
            "launcher.pg_timeout_s",
            self.pg_timeout_s,
            f"> 0 and <= {MAX_SECONDS:g}",
        )
        check(
            self.heartbeat_s == 0 or 1 <= self.heartbeat_s <= MAX_SECONDS,
            "launcher.heartbeat_s",
            self.heartbeat_s,
            "0 (the watch off) or >= 1 (seconds; a shorter silence is scheduling noise)",
        )
        pos_int("launcher.threads_per_rank", self.threads_per_rank)
