"""Checks of this host before any rank starts: what a valid config can still not do here.

``config.RunConfig`` validates settings against each other, anywhere; the runner then calls
:func:`check_before_launch` on the host that starts the ranks, which looks at that host: the
corpus ``data.path`` names (read as the ranks will), the checkpoint directory a saving run will
write to, and, for the local launcher (``cluster=local`` / ``emulated``: every rank on this
host; not under torchrun, where each host starts its own), whether that many ranks and their
model states fit this machine. Each refusal is a :class:`config.ConfigError`: ``error: ...``,
exit 2, nothing started.

Written here rather than taken from a library: the estimate is ZeRO's own formula
(``zeropp.runtime.memory.expected_by_tier``, the one ``experiments.runner.memory`` prints), and the
host's size comes from the standard library (``os.sched_getaffinity``, ``os.sysconf``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zeropp.comm import context
from zeropp.disk_space import FreeSpace, free_space
from zeropp.output_files import creation_refused, nearest_existing

from .config import ConfigError, RunConfig
from .console import human_bytes
from .data import DataError, check_corpus

RANKS_PER_CPU = 4
"""Most CPU ranks the local launcher starts per CPU this process may use: past that the ranks
only wait for each other (and gloo's timeouts fire), so more is a slip, not an experiment."""

FROZEN_BYTES = {"int8": 1.0, "int4": 0.5}
"""Bytes per frozen (LoRA base) parameter stored with ``zero.quantize_frozen``; ``none``: the compute dtype."""


def host_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_state_by_tier(
    rc: RunConfig,
    *,
    stage: int | None = None,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    persistent: tuple[int, int] | None = None,
) -> dict[str, dict[str, float]]:
    """ZeRO's model-state bytes per rank ``{tier: {params, grads, optimizer}}`` for this run, or for
    it at another ``stage`` / offload choice (``python -m experiments.memory``'s other rows):
    ``metrics.model_state_formula`` (the formula of the run's own ``memory_expected``) for the
    trainable parameters of this rank's tensor-parallel slice (Ψ/tp, a lower bound: embeddings and
    norms stay whole on every tp rank) partitioned over the data-parallel ranks, hpZ's secondary as
    the run keeps it (qwZ's wire rows), plus the stored shard of frozen (LoRA base) parameters,
    which have no gradient or optimizer state. At stage 3 the parameters under
    ``zero.persistence_threshold`` stay whole on every rank: ``persistent`` = (trainable, frozen) of
    them (default: counted by :func:`persistent_params`); the trainable ones with their whole
    optimizer state, the frozen ones outside the engine's frozen shards (and its model state).
    ``stage`` defaults to the trainer's (FSDP2 shards everything, DDP replicates everything)."""
    from .metrics import model_state_formula

    z, t = rc.zero, rc.topology
    fixed = rc.trainer_spec.fixed_stage
    if stage is None:
        stage = z.stage if fixed is None else fixed
    psi = rc.model.num_params()
    frozen = rc.model.with_(lora_rank=0).num_params() if rc.model.lora_rank else 0
    whole = frozen_whole = 0
    if stage == 3:
        whole, frozen_whole = persistent_params(rc) if persistent is None else persistent
    stored = (frozen - frozen_whole) / t.tp * FROZEN_BYTES.get(z.quantize_frozen, z.dtype.itemsize)
    return model_state_formula(
        z,
        t,
        stage=stage,
        offload_optimizer=z.offload_optimizer if offload_optimizer is None else offload_optimizer,
        offload_param=z.offload_param if offload_param is None else offload_param,
        trained=(psi - frozen) // t.tp,
        replicated=whole,
        frozen_bytes=stored / (t.dp_size if stage == 3 else 1),
    )


def _param_sizes(rc: RunConfig) -> list[tuple[int, bool]]:
    """``(elements, trainable)`` of each floating-point parameter of the run's model, built on the
    meta device (shapes only, no memory)."""
    from .trainers import meta_model

    return [(p.numel(), p.requires_grad) for p in meta_model(rc).parameters() if p.is_floating_point()]


def persistent_params(rc: RunConfig) -> tuple[int, int]:
    """``(trainable, frozen)`` parameters a stage-3 engine keeps whole on every rank, those with
    fewer elements than ``zero.persistence_threshold``: the trainable ones form its ``persistent``
    unit (``units.build_units``), the frozen ones stay out of its frozen shards
    (``frozen.build_frozen_units``); ``(0, 0)`` without a threshold."""
    z = rc.zero
    if not (rc.trainer_spec.zero_engine and z.persistence_threshold > 0):
        return 0, 0
    sizes = [(n, trained) for n, trained in _param_sizes(rc) if n < z.persistence_threshold]
    return sum(n for n, trained in sizes if trained), sum(n for n, trained in sizes if not trained)


def model_state_per_rank(rc: RunConfig) -> dict[str, float]:
    """ZeRO's model-state bytes per rank on each tier (``device``, ``host``, ``disk``) for this run:
    :func:`model_state_by_tier` summed over the categories."""
    from zeropp.runtime.memory import tier_totals

    return tier_totals(model_state_by_tier(rc))


def _ranks_on_cuda(rc: RunConfig, local_ranks: int) -> bool:
    """Whether the local launcher's ranks get GPUs (``zeropp.experiments.launch.select_device``'s choice)."""
    if rc.launcher.device == "cpu" or rc.cluster.name == "emulated":
        return False
    import torch

    return torch.cuda.device_count() >= local_ranks


def check_local_ranks(rc: RunConfig) -> None:
    """The local launcher starts every rank on this host: at most one per GPU for CUDA ranks,
    :data:`RANKS_PER_CPU` per CPU for CPU ranks, and their model states within physical memory."""
    t = rc.topology
    n = t.world_size
    shape = f"topology.nodes={t.nodes} x topology.ranks_per_node={t.ranks_per_node} = {n} ranks"
    if rc.launcher.device == "cuda":
        import torch

        if torch.cuda.device_count() < n:
            raise ConfigError(
                f"invalid config: launcher.device=cuda starts {n} ranks on this host but it has "
                f"{torch.cuda.device_count()} GPU(s); choose a topology of at most that many ranks "
                "(topology=1x1), launcher.device=cpu, or torchrun across hosts"
            )
    on_cuda = _ranks_on_cuda(rc, n)
    cpus = host_cpus()
    if not on_cuda and n > RANKS_PER_CPU * cpus:
        raise ConfigError(
            f"invalid config: {shape}, all started on this host as CPU processes, but it has {cpus} "
            f"CPU(s); allowed: at most {RANKS_PER_CPU * cpus} local CPU ranks ({RANKS_PER_CPU} per CPU). "
            "Choose a smaller topology (topology=2x2), or start each host's ranks with torchrun"
        )
    tiers = model_state_per_rank(rc)
    z = rc.zero
    swap = 4 * z.swap_buffers * z.swap_buffer_size if "nvme" in (z.offload_optimizer, z.offload_param) else 0
    state = tiers["host"] + (0 if on_cuda else max(tiers["device"], 4.0 * rc.model.num_params()))
    per_rank = state + swap
    total, phys = per_rank * n, host_memory()
    if total > phys:
        what = "host tier" if on_cuda else "device + host tiers, at least the fp32 model each CPU rank builds whole"
        if swap > state:  # the staging buffers, not the model, are what does not fit: say so and how
            raise ConfigError(
                f"invalid config: zero.swap_buffers={z.swap_buffers} x zero.swap_buffer_size={z.swap_buffer_size} "
                f"fp32 elements are {human_bytes(swap)} of nvme staging buffers per rank, {human_bytes(total)} "
                f"of host memory on {shape} with the model state ({human_bytes(state)} per rank: ZeRO's "
                f"formula, {what}), but this host has {human_bytes(phys)}. Lower zero.swap_buffer_size "
                f"(default {1 << 22}) or zero.swap_buffers (at least 2)"
            )
        raise ConfigError(
            f"invalid config: model (Ψ = {rc.model.num_params():,} parameters) on {shape} needs about "
            f"{human_bytes(total)} of host memory ({human_bytes(per_rank)} of model state per rank: "
            f"ZeRO's formula, {what}"
            + (f", with {human_bytes(swap)} of nvme staging buffers" if swap else "")
            + f") but this host has {human_bytes(phys)}; allowed: at most "
            f"{human_bytes(phys)}. Choose a smaller model (model=mini), fewer ranks, a higher stage or "
            "zero.offload_*=nvme, or torchrun across hosts"
        )


def disk_space(path: str | Path) -> FreeSpace:
    """The free space of the filesystem holding ``path``: what this process may write (the owner of
    an ext filesystem's reserved blocks may write into them) and what ``df`` shows (``zeropp.disk_space``)."""
    return free_space(path)


def disk_free(path: str | Path) -> int:
    """Bytes this process may still write on the filesystem holding ``path``."""
    return disk_space(path).usable


def free_words(space: FreeSpace) -> str:
    """``space`` for a refusal, in ``df``'s terms where the two differ: a user compares it with ``df``."""
    if not space.reserved:
        return f"{human_bytes(space.usable)} free"
    return (
        f"{human_bytes(space.usable)} free to this process ({human_bytes(space.shown)} in df's Avail column "
        f"and {human_bytes(space.reserved)} of blocks the filesystem reserves for their owner, which this process is)"
    )


def check_nvme_space(rc: RunConfig, ranks: int) -> None:
    """The nvme tier preallocates its swap files when the engine starts (``swap.SwapSpace.create``):
    ``ranks`` ranks on this host need about ZeRO's disk tier each under ``zero.nvme_path``. A disk
    too small would stop every rank after start-up, mid-construction; refuse it here instead. Only a
    lower bound on what is needed (the files pad their units, other runs may share the disk), so a
    tight disk can still fail at creation, with the file named."""
    z = rc.zero
    if z.nvme_path is None:
        return
    per_rank = model_state_per_rank(rc)["disk"]
    need, space = per_rank * ranks, disk_space(z.nvme_path)
    if need > space.usable:
        left = _swap_folders(Path(z.nvme_path))
        raise ConfigError(
            f"invalid config: zero.nvme_path={z.nvme_path!r} has {free_words(space)} but the nvme "
            f"tier's swap files need about {human_bytes(need)} ({human_bytes(per_rank)} per rank x "
            f"{ranks} ranks on this host: ZeRO's formula, disk tier); free space there, point "
            "zero.nvme_path at a larger disk, or keep part of the state in host memory "
            "(zero.offload_param=cpu / zero.offload_optimizer=cpu)"
            + (
                f". It holds {len(left)} swap folder(s) of other runs ({human_bytes(sum(left.values()))}: "
                f"{', '.join(sorted(left)[:3])}{', ...' if len(left) > 3 else ''}), left by a runner that was "
                "killed or still in use by a run: remove those of runs that no longer run"
                if left
                else ""
            )
        )


def _swap_folders(root: Path) -> dict[str, int]:
    """``zeropp-swap-*`` folders directly under ``root`` and the bytes of their files: the nvme
    tier's, of running runs or left by a SIGKILLed runner (which cannot remove them)."""
    out: dict[str, int] = {}
    try:
        for d in root.glob("zeropp-swap-*"):
            if d.is_dir() and not d.is_symlink():
                out[d.name] = sum(f.stat().st_size for f in d.iterdir() if f.is_file() and not f.is_symlink())
    except OSError:
        pass
    return out


def check_persistence(rc: RunConfig) -> None:
    """At stage 3, parameters with fewer elements than ``zero.persistence_threshold`` stay whole on
    every rank with their whole gradient and optimizer state (frozen ones whole too). A threshold
    above every parameter of the model (DeepSpeed's default of 1e5 on a small model) leaves nothing
    to shard: the run is stage 0 in memory under stage 3's name, and ``zero.offload_param`` moves
    nothing. Refused, naming the largest parameter."""
    z = rc.zero
    if not (rc.trainer_spec.zero_engine and z.stage == 3 and z.persistence_threshold > 0):
        return
    largest = max((n for n, _ in _param_sizes(rc)), default=0)  # frozen ones too
    if largest and largest < z.persistence_threshold:
        offload = f", and zero.offload_param={z.offload_param} would move nothing" if z.offload_param != "none" else ""
        kept = (
            "optimizer state"
            if z.offload_optimizer == "none"
            else f"optimizer state (on the {z.offload_optimizer} tier)"
        )
        # the replicated alternative that keeps this run's other settings: stage 0 takes no optimizer offload
        other = (
            "stage=0" if z.offload_optimizer == "none" else f"stage=1 with zero.offload_optimizer={z.offload_optimizer}"
        )
        raise ConfigError(
            f"invalid config: zero.persistence_threshold={z.persistence_threshold} is above every "
            f"parameter of this model (the largest has {largest:,} elements), so stage 3 would keep them all "
            f"whole on every rank with their whole gradients and {kept}: no parameter sharded under "
            f"stage 3's name{offload}. Lower zero.persistence_threshold to at most {largest:,} (0 shards "
            f"every parameter), or use {other}"
        )


_WARNED: set[str] = set()
"""Warnings this process printed already (each once, however many sweep points share it)."""


def warn_once(message: str) -> None:
    """``zeropp: warning: <message>`` on stderr, the first time this process gives that message."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"zeropp: warning: {message}", file=sys.stderr, flush=True)


def warn_hpz_on_one_node(rc: RunConfig) -> None:
    """hpZ (``zero.hpz``: ``quant=hpz`` / ``zeropp``) keeps a secondary partition of stage 3's
    parameters inside each node so backward gathers them without crossing nodes. On one node whose
    hpZ group is the whole node (``zero.hpz_size`` unset or ``ranks_per_node``) that partition is
    the primary one over again: no traffic saved, its copy's memory spent. Warned once, not refused:
    the ``quant=zeropp`` preset and ``sweep=ablation`` bundle it, and the run is still correct (the
    engine and FSDP2 honour it the same way on any topology). Printed by the local launcher, or by
    torchrun's rank 0 alone (every torchrun rank runs these checks: one line, not one per rank)."""
    z, t = rc.zero, rc.topology
    if os.environ.get("RANK", "0") != "0":
        return
    if z.hpz and t.nodes == 1 and (z.hpz_size or t.ranks_per_node) == t.ranks_per_node:
        warn_once(
            f"zero.hpz=true on one node (topology {t.nodes}x{t.ranks_per_node}): hpZ's secondary partition spans "
            f"the same {t.dp_size} data-parallel rank(s) as the primary one, so it saves no cross-node traffic and "
            "only adds its copy's memory; use topology.nodes >= 2 to measure hpZ, or add zero.hpz=false"
        )


MIN_OUTPUT_FREE = 1 << 20
"""Free bytes below which an output directory's disk counts as full: the smallest records a command
writes (Hydra's ``.hydra/`` files, a summary, a report) are kilobytes; what is larger (checkpoints,
swap files) is checked against its own size where it is written."""


def check_writable_dir(key: str, path: Path, *, room: bool = True) -> None:
    """``path`` is a directory this process can create files in, or can be created: its nearest
    existing ancestor is a directory that lets this process create files. Tried for real
    (``zeropp.output_files.creation_refused``: a temporary file removed at once), since permission
    bits lie for root and on read-only mounts; nothing is left behind. ``room``: also refuse a full
    disk (:data:`MIN_OUTPUT_FREE`); False where the caller checks the room its files need itself."""
    existing = nearest_existing(path.expanduser())  # "/" or "." at worst (missing only if the cwd was deleted)
    if not existing.is_dir():
        what = "is not a directory" if existing.exists() or existing.is_symlink() else "does not exist"
        raise ConfigError(
            f"invalid config: {key}={str(path)!r} cannot be created: {existing} {what}; choose another {key}"
        )
    err = creation_refused(existing)
    if err is not None:
        raise ConfigError(
            f"invalid config: {key}={str(path)!r} cannot be written: {existing} does not let this "
            f"process create files ({err.strerror or err}); choose a directory you can write to"
        )
    # an empty file can still be created on a full disk; its contents cannot
    if room and (space := disk_space(existing)).usable < MIN_OUTPUT_FREE:
        raise ConfigError(
            f"invalid config: {key}={str(path)!r} is on a full disk ({free_words(space)} at {existing}); "
            f"free space there or choose a directory on another disk"
        )


def check_before_launch(rc: RunConfig, run_dir: Path, *, local: bool) -> None:
    """Every host check before any rank starts; ``local``: this process starts all the ranks
    (the local launcher), so the rank count and memory are checked too."""
    try:
        context.debug_streams_from_env()  # each rank reads them again: refuse a typo before any starts
        context.debug_collectives_from_env()
    except ValueError as e:
        raise ConfigError(f"invalid environment: {e}") from None
    if rc.data.kind == "text" and rc.data.source == "path":
        try:
            check_corpus(rc.data, rc.model.seq_len)
        except DataError as e:
            raise ConfigError(f"invalid config: {e}") from None
    if rc.train.checkpoint_every > 0:
        check_writable_dir("train.checkpoint_dir", rc.checkpoint_dir(run_dir))  # null: <run dir>/checkpoints
    check_persistence(rc)
    warn_hpz_on_one_node(rc)
    if rc.zero.nvme_path is not None:  # ZeroConfig saw a writable directory by its bits; /proc passes that
        check_writable_dir("zero.nvme_path", Path(rc.zero.nvme_path), room=False)  # its room: check_nvme_space
    if local:  # under torchrun cluster=emulated is refused as such (run.execute)
        check_emulated_nodes(rc)
        check_emulated_privileges(rc)
        check_local_ranks(rc)
        check_nvme_space(rc, rc.topology.world_size)
        check_shm(rc)


def check_shm(rc: RunConfig) -> None:
    """``zero.transport=shm`` (``zeropp.comm.shm``): CPU ranks, and room under ``/dev/shm`` for the
    region of each ZeRO group on this host (one per tensor-parallel index). Each rank would raise the
    same refusal after start-up; here it comes before any rank starts."""
    if rc.zero.transport != "shm":
        return
    from zeropp.comm.shm import DEFAULT_REGION_BYTES, SHM_DIR

    if rc.launcher.device == "cuda" or _ranks_on_cuda(rc, rc.topology.world_size):
        raise ConfigError(
            "invalid config: zero.transport=shm moves CPU tensors through this host's shared memory, but the "
            "ranks run on GPUs; set zero.transport=backend (NCCL has its own shared-memory paths) or "
            "launcher.device=cpu"
        )
    need = DEFAULT_REGION_BYTES * rc.topology.tp
    try:
        free = disk_free(SHM_DIR)
    except OSError as e:
        raise ConfigError(
            f"invalid config: zero.transport=shm needs {SHM_DIR}, which this host lacks ({e.strerror}); "
            "set zero.transport=backend"
        ) from None
    if free < need:
        raise ConfigError(
            f"invalid config: zero.transport=shm needs {human_bytes(need)} under {SHM_DIR} but it has "
            f"{human_bytes(free)} free; free space there (in a container: a larger --shm-size) or set "
            "zero.transport=backend"
        )


def check_emulated_nodes(rc: RunConfig) -> None:
    """``cluster=emulated`` shapes the links *between* nodes: with one node there is none, so the
    run would be a plain local run that records a link rate (``cluster.inter_gbps``) nothing
    crossed, which ``scaling_check`` then reads as the run's cross-node rate. Refused, as
    ``bench_comm --cluster emulated --nodes 1`` is."""
    t = rc.topology
    if rc.cluster.name == "emulated" and t.nodes < 2:
        raise ConfigError(
            f"invalid config: cluster=emulated with topology {t.nodes}x{t.ranks_per_node} has one node, so no "
            f"link is shaped and cluster.inter_gbps={rc.cluster.inter_gbps:g} would do nothing; use topology.nodes "
            ">= 2 (e.g. topology=2x2), or cluster=local for one node"
        )


def check_emulated_privileges(rc: RunConfig) -> None:
    """``cluster=emulated`` needs root and iproute2: checked here, so the refusal (``netns``'s
    message, which says how to run with ``cluster=local``) comes before the run directory gets its
    ``ranks/`` and the runner announces a run, as every other host check does."""
    if rc.cluster.name != "emulated":
        return
    from ..cluster.netns import ClusterPrivilegeError, require_privileges

    try:
        require_privileges()
    except ClusterPrivilegeError as e:
        raise ConfigError(f"cluster=emulated cannot build its namespaces: {e}") from None
