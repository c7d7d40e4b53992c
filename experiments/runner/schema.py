"""The Hydra schema of the runner, generated from the library's config dataclasses.

Why generated: every setting is declared once, in the frozen dataclasses that validate it
(``zeropp.runtime.ZeroConfig``, ``OptimizerConfig``, ``zeropp.models.GPTConfig``,
``zeropp.comm.Topology``, ``zeropp.comm.spec.QuantSpec`` and the harness's own sections in
``config.py``). :func:`schema_of` turns each into a plain (mutable) dataclass with the same field
names, types and defaults, which Hydra uses as a structured config: an unknown key or a value of
the wrong type is refused by OmegaConf while composing, and the values are then handed to the
library classes, whose ``__post_init__`` checks the rest. A fixed-choice field (a ``str`` enum,
``zeropp.comm.choices``: ``zero.precision``, ``zero.offload_param``, ``zero.grads.rounding``...)
keeps its enum type, so OmegaConf refuses any other value while composing and names the valid
ones. Adding a field to ``ZeroConfig`` makes it a command-line override with no edit here.

The config groups whose options are library objects are generated too: ``quant=`` from
``zeropp.comm.spec.RECIPES``, ``model=`` from ``zeropp.models.gpt.PRESETS`` plus ``hf`` (a Hugging
Face model, ``zeropp.models.HFConfig``'s defaults), ``topology=`` as
``<nodes>x<ranks per node>``, ``trainer=`` and ``+trainer_job=`` (one trainer with the ``quant=``
it runs in ``sweep=trainers``) from ``trainer_registry.TRAINER_SPECS``. The harness-only groups
(data, logger, cluster, sweep) stay YAML files under ``conf/``.

The ``model`` section holds more than one library class (``config.MODEL_KINDS``): its schema is
:func:`model_schema`, ``kind`` plus the union of the kinds' fields, so every key of every kind is a
typed override and each kind's group option sets ``kind``; ``config.build_model_config`` then
builds the chosen class and refuses keys of another kind that were changed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Optional, Union

from hydra.core.config_store import ConfigStore

from zeropp.comm.spec import RECIPES, QuantSpec
from zeropp.models import HFConfig
from zeropp.models.gpt import PRESETS as MODEL_PRESETS
from zeropp.runtime import ZeroConfig

from .config import EXCLUDED, MODEL_KINDS, SECTION_CLASSES
from .trainer_registry import TRAINER_SPECS

TOPOLOGIES = ("1x1", "1x2", "1x4", "2x1", "2x2", "2x4", "4x1", "4x2", "3x2")
"""``topology=`` options (nodes x ranks per node); any other shape: ``topology.nodes=N topology.ranks_per_node=R``."""


def _schema_type(tp: Any) -> Any:
    """The OmegaConf-compatible annotation of a library field type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _schema_type(args[0]) if len(args) == 1 else Any
        return Optional[inner] if inner is not Any else Any
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return schema_of(tp)
    if origin is tuple:
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:  # tuple[X, ...]: a list on the command line, [3,4]
            return typing.List[_schema_type(items[0])]  # type: ignore[misc]
        return typing.Tuple[tuple(_schema_type(a) for a in items)]
    if tp in (int, float, bool, str):
        return tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a fixed choice: OmegaConf refuses other values
        return tp
    return Any


def _copy_into(schema: type, default: Any) -> Any:
    """A fresh ``schema`` instance holding ``default``'s field values (a per-instance default)."""
    return schema(**{k.name: getattr(default, k.name) for k in dataclasses.fields(schema)})


@functools.cache  # one schema class per (class, exclusions): OmegaConf compares them
def schema_of(cls: type, exclude: tuple[str, ...] = ()) -> type:
    """A mutable dataclass mirroring ``cls``'s fields (names, types, defaults), minus ``exclude``."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        tp = _schema_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                # a dataclass instance default: rebuild per instance
                sub = schema_of(type(default))
                fields.append(
                    (f.name, tp, dataclasses.field(default_factory=functools.partial(_copy_into, sub, default)))
                )
            else:
                fields.append((f.name, tp, dataclasses.field(default=default)))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, tp, dataclasses.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp, dataclasses.field(default="???")))  # OmegaConf's MISSING
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


@functools.cache
def model_schema() -> type:
    """The ``model`` section: ``kind`` (default ``gpt``) and every field of every model kind, typed
    and defaulted as the library declares it (the first kind declaring a name gives its default)."""
    fields: list[tuple[str, Any, Any]] = [("kind", str, dataclasses.field(default=next(iter(MODEL_KINDS))))]
    seen: dict[str, Any] = {"kind": str}
    for cls in MODEL_KINDS.values():
        sub = schema_of(cls)
        hints = typing.get_type_hints(sub)
        for f in dataclasses.fields(sub):
            if f.name in seen:
                if seen[f.name] != hints[f.name]:
                    raise TypeError(
                        f"model.{f.name} has type {seen[f.name]} in one model kind and {hints[f.name]} "
                        f"in {cls.__name__}; shared model keys must mean the same"
                    )
                continue
            seen[f.name] = hints[f.name]
            fields.append((f.name, hints[f.name], dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass("ModelSchema", fields)


def run_schema() -> type:
    """The whole run: top-level keys (``stage``, ``resume``) and one node per section."""
    fields: list[tuple[str, Any, Any]] = [
        ("stage", int, dataclasses.field(default=ZeroConfig().stage)),
        ("resume", bool, dataclasses.field(default=False)),
    ]
    for name, cls in SECTION_CLASSES.items():
        sub = model_schema() if name == "model" else schema_of(cls, EXCLUDED.get(name, ()))
        fields.append((name, sub, dataclasses.field(default_factory=sub)))
    return dataclasses.make_dataclass("RunSchema", fields)


def _spec_node(spec: QuantSpec | None) -> dict[str, Any] | None:
    return None if spec is None else dataclasses.asdict(spec)


def register() -> None:
    """Store the schema and the generated group options in Hydra's ConfigStore, and the resolvers
    conf/config.yaml uses (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("zeropp_tenth"):  # LR warmup: a tenth of the run by default
        OmegaConf.register_new_resolver("zeropp_tenth", lambda steps: int(steps) // 10)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=run_schema())
    for name, r in RECIPES.items():
        cs.store(
            group="quant",
            name=name,
            package="zero",
            node={
                "weights": _spec_node(r.weights),
                "grads": _spec_node(r.grads),
                "weight_diff": _spec_node(r.weight_diff),
                "hpz": r.hpz,
            },
        )
    for name, sizes in MODEL_PRESETS.items():
        cs.store(group="model", name=name, package="model", node={"kind": "gpt", **sizes})
    # model=hf: every HFConfig field at its default, so the union's GPT defaults of shared keys are replaced
    cs.store(group="model", name="hf", package="model", node={"kind": "hf", **dataclasses.asdict(HFConfig())})
    for name in TOPOLOGIES:
        n, per_node = (int(x) for x in name.split("x"))
        cs.store(group="topology", name=name, package="topology", node={"nodes": n, "ranks_per_node": per_node})
    for name, spec in TRAINER_SPECS.items():
        cs.store(group="trainer", name=name, package="trainer", node={"name": name})
        # sweep=trainers' job: the trainer and what it quantizes, as a global override of both groups
        cs.store(
            group="trainer_job",
            name=name,
            package="_global_",
            node={"defaults": [{"override /trainer": name}, {"override /quant": spec.sweep_quant}]},
        )


def group_options() -> dict[str, list[str]]:
    """Generated group -> option names (for the command-line pre-check and ``--help``)."""
    return {
        "quant": sorted(RECIPES),
        "model": [*MODEL_PRESETS, "hf"],
        "topology": list(TOPOLOGIES),
        "trainer": list(TRAINER_SPECS),
    }


__all__ = ["TOPOLOGIES", "group_options", "model_schema", "register", "run_schema", "schema_of"]
