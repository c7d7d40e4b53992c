"""The trainers a run can name (``trainer=<name>``), each declared once as a :class:`TrainerSpec`.

A spec says what builds the trainer, which ``zero.*`` settings it reads and what it can do. Every
consumer asks the registry (:data:`TRAINER_SPECS`) instead of keeping its own table: the config
refuses a setting the chosen trainer does not honour, a precision or tensor parallelism it lacks,
checkpoints it cannot write, before any rank starts (``config.py``); the Hydra schema generates
the ``trainer=`` and ``trainer_job=`` groups from it (``schema.py``); the worker builds through it
(``trainers.build_trainer``).

Why the builder is a reference (``".trainers:ZeroTrainer"``, the form of a Python entry point)
rather than the callable itself: the builders take a validated ``RunConfig``, and validating a
``RunConfig`` consults this registry, so holding the callables here would make this module and the
config import each other. The reference is resolved by :func:`resolve_builder` (the stdlib's
``pkgutil.resolve_name``) when a rank builds its trainer; a test resolves every registered one.

A new trainer: implement the ``trainers.Trainer`` protocol, then :func:`register_trainer` its spec
before the runner composes its config (the schema's groups are generated from the registry then).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import Any

__all__ = [
    "TRAINER_SPECS",
    "TrainerSpec",
    "missing_requirement",
    "register_trainer",
    "resolve_builder",
    "trainer_names",
]

PRECISIONS = ("fp32", "bf16", "fp16")
"""Values of ``zero.precision`` (``zeropp.comm.choices.Precision``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """One trainer: its name, builder, the settings it honours and its capabilities."""

    name: str
    """``trainer=<name>``: a Python identifier (it names a Hydra group option)."""
    builder: str
    """``"<module>:<callable>"``: ``callable(cfg: RunConfig, device: torch.device) -> Trainer``,
    called after the process group is up. A module starting with ``.`` is relative to this
    package (``".trainers:ZeroTrainer"``)."""
    honours: frozenset[str] | None = None
    """The ``zero.*`` keys it reads (``"stage"`` for the top-level stage key); None: every one.
    Setting any other ``zero.*`` key away from its default is a config error naming this trainer.
    Keys of the other sections are read by every trainer."""
    stage_note: str = ""
    """Why ``stage`` means nothing to it, when ``honours`` leaves ``stage`` out (it is shown in the
    error: ``"FSDP2 is always ZeRO-3"``)."""
    precisions: tuple[str, ...] = ("fp32", "bf16")
    """The ``zero.precision`` values it trains in (fp16 needs a loss scaler)."""
    tensor_parallel: bool = False
    """Whether it splits the model over ``topology.tp > 1``."""
    checkpoint: bool = True
    """Whether it saves and resumes checkpoints (``train.checkpoint_every``, ``resume=true``)."""
    needs_any_of: tuple[str, ...] = ()
    """``zero.*`` keys of which at least one must be set (not None): a trainer whose point is a
    quantized collective. Empty: no such need."""
    needs_message: str = ""
    """The error when none of ``needs_any_of`` is set: what is missing and what to choose."""
    sweep_quant: str = "none"
    """The ``quant=`` recipe of its job in ``sweep=trainers`` (``+trainer_job=<name>``): what it
    quantizes when all trainers run side by side."""
    zero_engine: bool = False
    """Whether it is zeropp's ``ZeroEngine``, whose step the plan, the profile ranges and the ZeRO
    memory formulas by tier describe (the other trainers report their flat model state only)."""
    fixed_stage: int | None = None
    """The ZeRO stage whose model state it holds when it has no ``stage`` of its own (FSDP2 shards
    everything: 3; DDP replicates everything: 0); None when it honours ``stage``."""
    requires: str = ""
    """The module of an optional package it needs (``"deepspeed"``); empty: none. A run naming it
    without that package installed is refused before any rank starts, with :attr:`install_hint`.
    Such a trainer stays out of ``sweep=trainers``, which must run wherever zeropp does."""
    install_hint: str = ""
    """What :attr:`requires` is and how to install it (``"DeepSpeed: pip install 'zeropp[peers]'"``)."""

    @property
    def in_trainer_sweep(self) -> bool:
        """Whether ``sweep=trainers`` runs it (every trainer that needs no optional package)."""
        return not self.requires

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"TrainerSpec.name={self.name!r}: must be a Python identifier (it names a Hydra option)")
        module, sep, attr = self.builder.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"TrainerSpec.builder={self.builder!r}: must be '<module>:<callable>'")
        if self.honours is not None:
            if not isinstance(self.honours, frozenset):
                object.__setattr__(self, "honours", frozenset(self.honours))
            bad = sorted(k for k in self.honours or () if k != "stage" and not k.startswith("zero."))
            if bad:
                raise ValueError(f"TrainerSpec.honours: {bad} are not zero.* keys (nor 'stage')")
            if "stage" not in self.honours and not self.stage_note:
                raise ValueError("TrainerSpec.stage_note: say why the stage means nothing to this trainer")
        bad_prec = [p for p in self.precisions if p not in PRECISIONS]
        if not self.precisions or bad_prec:
            raise ValueError(f"TrainerSpec.precisions={self.precisions!r}: allowed values {PRECISIONS}")
        if any(not k.startswith("zero.") for k in self.needs_any_of):
            raise ValueError(f"TrainerSpec.needs_any_of={self.needs_any_of!r}: zero.* keys only")
        if bool(self.needs_any_of) != bool(self.needs_message):
            raise ValueError("TrainerSpec.needs_any_of and needs_message go together")
        if bool(self.requires) != bool(self.install_hint):
            raise ValueError("TrainerSpec.requires and install_hint go together")
        if (self.fixed_stage is None) != self.honours_key("stage"):
            raise ValueError("TrainerSpec.fixed_stage: set it exactly when honours leaves 'stage' out")
        if self.fixed_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"TrainerSpec.fixed_stage={self.fixed_stage!r}: a ZeRO stage 0-3")

    def honours_key(self, key: str) -> bool:
        """Whether it reads ``key`` (``"zero.<field>"`` or ``"stage"``)."""
        return self.honours is None or key in self.honours


TRAINER_SPECS: dict[str, TrainerSpec] = {}
"""``trainer=<name>`` -> its spec, in registration order (the built-in ones first)."""


def register_trainer(spec: TrainerSpec) -> TrainerSpec:
    """Add ``spec`` to :data:`TRAINER_SPECS`; a name already registered is refused."""
    if spec.name in TRAINER_SPECS:
        raise ValueError(f"trainer {spec.name!r} is registered already ({TRAINER_SPECS[spec.name].builder})")
    TRAINER_SPECS[spec.name] = spec
    return spec


def trainer_names() -> tuple[str, ...]:
    """Every registered ``trainer=`` name."""
    return tuple(TRAINER_SPECS)


def missing_requirement(spec: TrainerSpec) -> str | None:
    """``"trainer=<name> needs <install_hint>"`` when its :attr:`TrainerSpec.requires` module cannot be
    imported here, else None (nothing is imported: ``importlib.util.find_spec`` only looks)."""
    if spec.requires and importlib.util.find_spec(spec.requires) is None:
        return f"trainer={spec.name} needs {spec.install_hint}"
    return None


def resolve_builder(spec: TrainerSpec) -> Callable[..., Any]:
    """The callable ``spec.builder`` names (imported now)."""
    ref = spec.builder if not spec.builder.startswith(".") else f"{__package__}{spec.builder}"
    fn = pkgutil.resolve_name(ref)
    if not callable(fn):
        raise TypeError(f"trainer={spec.name}: builder {spec.builder!r} is not callable")
    return fn


_COMMON = frozenset({"zero.precision", "zero.grad_accum_steps", "zero.grad_clip"})

# zeropp's ZeroEngine: stages 0-3 with qwZ / hpZ / qgZ, offload, tensor parallelism, fp16 loss scaling
register_trainer(
    TrainerSpec(
        name="zeropp",
        builder=".trainers:ZeroTrainer",
        honours=None,
        precisions=("fp32", "bf16", "fp16"),
        tensor_parallel=True,
        sweep_quant="w8g4",
        zero_engine=True,
    )
)
# PyTorch FSDP2: fully_shard on every block and the root; zero.hpz = reshard_after_forward to the hpZ group
register_trainer(
    TrainerSpec(
        name="fsdp2",
        builder=".torch_trainers:build_fsdp2",
        honours=_COMMON | {"zero.hpz", "zero.hpz_size"},
        stage_note="FSDP2 is always ZeRO-3",
        fixed_stage=3,
    )
)
# FSDP2 with zeropp's quantized collectives plugged in (zero.weights / zero.grads)
register_trainer(
    TrainerSpec(
        name="fsdp2_zeropp",
        builder=".torch_trainers:build_fsdp2_zeropp",
        honours=_COMMON | {"zero.hpz", "zero.hpz_size", "zero.weights", "zero.grads"},
        stage_note="FSDP2 is always ZeRO-3",
        fixed_stage=3,
        needs_any_of=("zero.weights", "zero.grads"),
        needs_message="trainer=fsdp2_zeropp with nothing quantized; choose quant=int8, w8g4, ... or trainer=fsdp2",
        sweep_quant="w8g4",
    )
)
# PyTorch DistributedDataParallel; zero.reduce_bucket_size caps its buckets
register_trainer(
    TrainerSpec(
        name="ddp",
        builder=".torch_trainers:build_ddp",
        honours=_COMMON | {"zero.reduce_bucket_size"},
        stage_note="DDP replicates everything",
        fixed_stage=0,
    )
)
# DDP with zeropp's quantized gradient all-reduce hook (zero.grads)
register_trainer(
    TrainerSpec(
        name="ddp_zeropp",
        builder=".torch_trainers:build_ddp_zeropp",
        honours=_COMMON | {"zero.reduce_bucket_size", "zero.grads"},
        stage_note="DDP replicates everything",
        fixed_stage=0,
        needs_any_of=("zero.grads",),
        needs_message=(
            "trainer=ddp_zeropp needs zero.grads (its hook quantizes the gradient all-reduce); e.g. quant=qgz"
        ),
        sweep_quant="qgz",
    )
)
# DeepSpeed's ZeRO at `stage` (torch's AdamW as a client optimizer): the peer users would pick instead
register_trainer(
    TrainerSpec(
        name="deepspeed",
        builder=".deepspeed_trainer:build_deepspeed",
        honours=_COMMON | {"stage"},
        checkpoint=False,
        requires="deepspeed",
        install_hint="DeepSpeed: pip install 'zeropp[peers]'",
    )
)
