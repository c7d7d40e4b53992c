"""The checks of a :class:`~.config.RunConfig` across its sections, run by its ``__post_init__``
(and :func:`check_finite` by ``config._build`` for every field): what the chosen trainer honours
and can do (a precision, tensor parallelism, checkpoints, the ``zero.*`` keys it reads), the
model's split under ``topology.tp``, settings that only another setting reads, and finite floats.
Each refusal is a :class:`~.checks.ConfigError` naming the key and the fix. Apart from the config
class so that it stays what a run is, and these what a run may not be.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any, Protocol

from zeropp.comm import QuantSpec, Topology
from zeropp.models import GPTConfig, HFConfig
from zeropp.runtime import ZeroConfig

from .checks import ConfigError, unused
from .sections import TrainConfig
from .trainer_registry import TRAINER_SPECS, TrainerSpec


class RunSections(Protocol):
    """What the checks read of a :class:`~.config.RunConfig` (which calls them, so this module
    cannot import it)."""

    @property
    def zero(self) -> ZeroConfig: ...

    @property
    def model(self) -> GPTConfig | HFConfig: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def train(self) -> TrainConfig: ...

    @property
    def resume(self) -> bool: ...


__all__ = [
    "RunSections",
    "check_capabilities",
    "check_finite",
    "check_settings_in_use",
    "check_tp",
    "check_trainer_keys",
    "trainers_that",
]


def trainers_that(ok: Callable[[TrainerSpec], bool]) -> str:
    """``trainer=a / trainer=b``: the registered trainers for which ``ok(spec)`` holds."""
    return " / ".join(f"trainer={n}" for n, s in TRAINER_SPECS.items() if ok(s)) or "no registered trainer"


def check_capabilities(rc: RunSections, spec: TrainerSpec) -> None:
    """What the run asks of its trainer beyond single keys: a precision, tensor parallelism,
    checkpoints, and the quantized collective a trainer exists for."""
    name, z = spec.name, rc.zero
    if z.precision not in spec.precisions:
        raise ConfigError(
            f"invalid config: zero.precision={z.precision} with trainer={name}; allowed: "
            f"{', '.join(spec.precisions)} (zero.precision={z.precision} is implemented by "
            f"{trainers_that(lambda s: z.precision in s.precisions)})"
        )
    if spec.needs_any_of and all(getattr(z, k.removeprefix("zero.")) is None for k in spec.needs_any_of):
        raise ConfigError(f"invalid config: {spec.needs_message}")
    if rc.topology.tp > 1 and not spec.tensor_parallel:
        raise ConfigError(
            f"invalid config: topology.tp={rc.topology.tp} with trainer={name}; tensor parallelism is "
            f"implemented by {trainers_that(lambda s: s.tensor_parallel)} only (or set topology.tp=1)"
        )
    if not spec.checkpoint and (rc.train.checkpoint_every or rc.resume):
        key = "resume=true" if rc.resume else f"train.checkpoint_every={rc.train.checkpoint_every}"
        raise ConfigError(
            f"invalid config: {key} with trainer={name}, which cannot save or load checkpoints; "
            "remove it, or use a trainer that can: "
            f"{trainers_that(lambda s: s.checkpoint)}"
        )


def check_tp(rc: RunSections) -> None:
    """``topology.tp > 1`` (with a trainer that splits models): the model's heads and widths must
    divide (checkpoints of a split model load at the same tp, which ``ZeroEngine.load_checkpoint`` checks)."""
    from zeropp.models.gpt import check_gpt_tp
    from zeropp.models.hf import check_hf_tp

    try:
        if isinstance(rc.model, HFConfig):
            check_hf_tp(rc.model, rc.topology.tp)
        else:
            check_gpt_tp(rc.model, rc.topology.tp)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None


def check_settings_in_use(rc: RunSections) -> None:
    """Settings that only another setting reads stay at their defaults (nothing is silently
    ignored): the checkpoint keys without checkpointing, the nvme tier's staging buffers without
    the nvme tier, MixZ++'s frozen storage without LoRA (no frozen parameters), stage 3's prefetch
    depth at stages 0-2 (the library refuses its siblings
    ``persistence_threshold``, ``keep_at_turn`` and ``nvme_path`` the same way)."""
    train, zero, default = rc.train, rc.zero, ZeroConfig()
    if train.checkpoint_every == 0:
        if not rc.resume:
            unused(
                "train.checkpoint_dir",
                train.checkpoint_dir,
                None,
                "train.checkpoint_every=0 and no resume=true (nothing is saved there or loaded from it)",
                "set train.checkpoint_every=N to save there, resume=true to continue from it, or remove it",
            )
        unused(
            "train.keep_checkpoints",
            train.keep_checkpoints,
            TrainConfig().keep_checkpoints,
            "train.checkpoint_every=0 (this run saves no checkpoint)",
            "set train.checkpoint_every=N, or remove it",
        )
    if "nvme" not in (zero.offload_optimizer, zero.offload_param):
        for name in ("swap_buffers", "swap_buffer_size"):
            unused(
                f"zero.{name}",
                getattr(zero, name),
                getattr(default, name),
                "no nvme tier (it sizes the nvme tier's host staging buffers)",
                "add zero.offload_optimizer=nvme or zero.offload_param=nvme with zero.nvme_path=<dir>, or remove it",
            )
    if not rc.model.lora_rank:  # the runner's models freeze parameters only under LoRA
        unused(
            "zero.quantize_frozen",
            zero.quantize_frozen,
            default.quantize_frozen,
            "model.lora_rank=0 (it stores frozen parameters quantized, and without LoRA nothing is frozen)",
            "set model.lora_rank=N to train LoRA adapters on a frozen base (MixZ++), or remove it",
        )
    if zero.stage != 3:
        unused(
            "zero.prefetch_depth",
            zero.prefetch_depth,
            default.prefetch_depth,
            f"stage={zero.stage} (it sets how far ahead stage 3 gathers its blocks)",
            "set stage=3, or remove it",
        )


def check_trainer_keys(rc: RunSections, spec: TrainerSpec) -> None:
    """Every ``zero.*`` key (and ``stage``) the trainer does not honour stays at its default."""
    name = spec.name
    default = ZeroConfig()
    if not spec.honours_key("stage") and rc.zero.stage != default.stage:
        raise ConfigError(
            f"invalid config: stage={rc.zero.stage} does nothing with trainer={name} ({spec.stage_note}); "
            f"remove it, or choose the stage with {trainers_that(lambda s: s.honours_key('stage'))}"
        )
    for f in dataclasses.fields(ZeroConfig):
        key = f"zero.{f.name}"
        if f.name == "stage" or spec.honours_key(key):
            continue
        value = getattr(rc.zero, f.name)
        if value != getattr(default, f.name):
            used = ", ".join(sorted(k.removeprefix("zero.") for k in spec.honours or () if k != "stage"))
            spec_set = isinstance(value, QuantSpec)  # most often by a quant= recipe: named by its label
            raise ConfigError(
                f"invalid config: {f'{key} ({value.label})' if spec_set else f'{key}={value!r}'} does nothing with "
                f"trainer={name}: it does not honour {key} (it uses only zero.{{{used}}}). Remove it"
                f"{f' ({key}=null, or a quant= recipe without it)' if spec_set else ''}, "
                f"or use {trainers_that(functools.partial(TrainerSpec.honours_key, key=key))}"
            )


def _mentions_float(tp: Any) -> bool:
    """True when a field annotation holds floats (``float``, ``float | None``, ``tuple[float, ...]``)."""
    return tp is float or any(_mentions_float(a) for a in typing.get_args(tp))


def check_finite(key: str, tp: Any, value: Any) -> None:
    """Every float setting of every section is finite: no setting means anything at inf or nan
    (a rate, a timeout, a learning rate, a loss scale), and where "off" exists it is ``null``.
    One check for every section, library ones included, so a new float field is covered too."""
    if not _mentions_float(tp):
        return
    for x in value if isinstance(value, tuple) else (value,):
        if isinstance(x, float) and not math.isfinite(x):
            raise ConfigError(
                f"invalid config: {key}={value!r}; allowed: a finite number (inf and nan are not settings)"
            )
