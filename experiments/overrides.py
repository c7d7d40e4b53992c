"""Command-line pre-check: clearer answers than Hydra's for the common slips.

Hydra refuses ``quant=int9`` or ``zero.prefetch_dept=2`` too, but buries the answer under its
config search path; :func:`check_overrides` runs before Hydra and names the override, the allowed
values and the closest match, then the runner exits 2 without starting anything. It walks the
same generated schema Hydra uses (``schema.run_schema``), so it knows every key of every section,
nested ones (``zero.grads.intra_bits``) included.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from .config import CONF_DIR, ConfigError
from .schema import group_options as generated_options, run_schema


def group_options(group: str) -> list[str]:
    """Option names of a config group: generated ones, or the yaml files in ``conf/<group>/``."""
    gen = generated_options()
    if group in gen:
        return gen[group]
    d = CONF_DIR / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def config_groups() -> list[str]:
    yaml_groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")]
    return sorted(set(yaml_groups) | set(generated_options()))


def _fields(schema: type) -> dict[str, type]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _sub_schema(tp: type) -> type | None:
    for cand in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(cand):
            return cand  # type: ignore[return-value]
    return None


def _check_key(key: str) -> None:
    """Every part of a dotted key must be a field of the schema node above it."""
    node: type | None = run_schema()
    path: list[str] = []
    for part in key.split("."):
        if node is None:
            raise ConfigError(f"unknown config key {key!r}: {'.'.join(path)} has no sub-keys")
        fields = _fields(node)
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields) + ([] if path else config_groups()), n=1)
            where = ".".join(path) or "top level"
            hint = f" (did you mean {'.'.join([*path, near[0]])}?)" if near else ""
            groups = f"; config groups: {', '.join(config_groups())}" if not path else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; keys of {where}: {', '.join(fields)}{groups}")
        path.append(part)
        node = _sub_schema(fields[part])


def _check_spec_key(key: str, args: list[str]) -> None:
    """``zero.weights.*`` / ``zero.grads.*`` refine the spec a ``quant=`` recipe sets; on a recipe
    that leaves it null there is nothing to refine (Hydra would fail obscurely)."""
    from zeropp.comm.spec import RECIPES

    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "zero" or parts[1] not in ("weights", "grads", "weight_diff"):
        return
    if any(a.startswith(("sweep=", "+trainer_job=")) for a in args):
        return  # the sweep chooses quant per job; Hydra reports a job whose recipe leaves the spec null
    chosen = [a.split("=", 1)[1] for a in args if a.startswith("quant=")]
    for name in (chosen[-1].split(",") if chosen else ["none"]):
        name = name.strip().strip("'\"")
        if name in RECIPES and getattr(RECIPES[name], parts[1]) is None:
            with_it = sorted(n for n, r in RECIPES.items() if getattr(r, parts[1]) is not None)
            raise ConfigError(f"invalid config: {key} refines the {parts[1]} spec, but quant={name} quantizes no "
                              f"{parts[1]}; first choose a recipe that does (quant={' / '.join(with_it)}), then "
                              f"refine it ({key}=...)")


def check_overrides(args: list[str]) -> None:
    """Reject a command-line override that names an unknown group option or key."""
    groups = config_groups()
    for arg in args:
        if arg.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if key in groups:
            options = group_options(key)
            for v in value.split(","):
                v = v.strip().strip("'\"")
                if v and v != "null" and v not in options and not v.startswith(("range(", "choice(", "glob(")):
                    near = difflib.get_close_matches(v, options, n=1)
                    hint = f" (did you mean {key}={near[0]}?)" if near else ""
                    raise ConfigError(f"invalid config: {key}={v!r} is not a {key} option{hint}; "
                                      f"allowed: {', '.join(options)}")
        else:
            _check_key(key)
            _check_spec_key(key, args)
