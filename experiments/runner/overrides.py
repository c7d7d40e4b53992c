"""Command-line pre-check: clearer answers than Hydra's for the common slips.

Hydra refuses ``quant=int9``, ``zero.prefetch_dept=2`` or ``train.steps=abc`` too, but buries
the answer under its config search path or a validation traceback; :func:`check_overrides` runs
before Hydra and names the override, the allowed values and the closest match, then the runner
exits 2 without starting anything. It walks the same generated schema Hydra uses
(``schema.run_schema``), so it knows every key of every section, nested ones
(``zero.grads.intra_bits``) included, and each key's type: values are parsed by Hydra's own
override parser (sweeps expanded) and converted by OmegaConf's own typed nodes, exactly as
composing will, so a value refused here is one Hydra would refuse.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

from .config import CONF_DIR, ConfigError
from .preflight import check_writable_dir
from .run_dir_checks import check_fresh_run_dir
from .schema import group_options as generated_options
from .schema import run_schema


def group_options(group: str) -> list[str]:
    """Option names of a config group: generated ones, or the yaml files in ``conf/<group>/``."""
    gen = generated_options()
    if group in gen:
        return gen[group]
    d = CONF_DIR / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def config_groups() -> list[str]:
    # conf/hydra/ holds options of Hydra's own groups (hydra/launcher=slurm), not the runner's
    yaml_groups = [
        p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_") and p.name != "hydra"
    ]
    return sorted(set(yaml_groups) | set(generated_options()))


def _fields(schema: type) -> dict[str, type]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _sub_schema(tp: type) -> type | None:
    for cand in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(cand):
            return cand  # type: ignore[return-value]
    return None


def _check_key(key: str) -> Any:
    """Every part of a dotted key must be a field of the schema node above it; returns the key's
    schema type."""
    node: type | None = run_schema()
    path: list[str] = []
    tp: Any = None
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
        tp = fields[part]
        node = _sub_schema(tp)
    return tp


_LEAF_NODES: dict[type, tuple[type, str]] = {
    int: (IntegerNode, "an integer"),
    float: (FloatNode, "a number"),
    bool: (BooleanNode, "true or false"),
    str: (StringNode, "a string"),
}
"""Schema leaf type -> the OmegaConf node that converts a value into it (as composing does) and
what to call the allowed values."""


def _text(value: Any) -> str:
    """A parsed override value as the user typed it (``null``, ``abc``, ``[0.9,inf]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value)


def _check_value(key: str, tp: Any, value: Any, shown: str | None = None) -> None:
    """One parsed override value must convert to the schema type ``tp`` (OmegaConf's own
    conversion: ``'3'`` is an integer, ``1.5`` is not); ``shown`` is what the message quotes."""
    shown = _text(value) if shown is None else shown
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: OmegaConf resolves and checks it
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is tuple:  # OmegaConf checks the elements' type; the library their count
        elems = typing.get_args(tp)
        if value is None and optional:
            return
        if not isinstance(value, list):
            raise ConfigError(
                f"invalid config: {key}={shown}: expected a list, e.g. [{','.join('0.9' for _ in elems)}]"
            )
        for v, e in zip(value, elems):
            _check_value(key, e, v, shown)
        return
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a fixed choice (zeropp.comm.choices)
        _check_choice(key, tp, value, shown, optional)
        return
    leaf = _LEAF_NODES.get(tp)
    if leaf is None:
        return  # a section or an untyped (Any) key: the library's __post_init__ checks it
    node, what = leaf
    if value is None:
        if not optional:
            raise ConfigError(f"invalid config: {key}=null: expected {what} (this key cannot be null)")
        return
    try:
        node(value=value, is_optional=optional)
    except ValidationError:
        raise ConfigError(
            f"invalid config: {key}={shown}: expected {what}" + (" or null" if optional else "")
        ) from None


def _check_choice(key: str, tp: type[enum.Enum], value: Any, shown: str, optional: bool) -> None:
    """A fixed-choice key: the value must be one of the enum's (OmegaConf's ``EnumNode``, as composing
    converts it), else an error naming the key, the valid values and the closest one."""
    if value is None and optional:
        return
    try:
        EnumNode(enum_type=tp, value=value, is_optional=optional)
    except ValidationError:
        valid = list(tp.__members__)
        near = difflib.get_close_matches(str(value), valid, n=1)
        hint = f" (did you mean {key}={near[0]}?)" if near else ""
        raise ConfigError(f"invalid config: {key}={shown}{hint}; allowed: {', '.join(valid)}") from None


def _values(override: Override) -> list[Any]:
    """The values an override sets: one, or each of a choice / range sweep (an interval sweep is
    a search space for a sweeper plugin, not values: left to it)."""
    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP):
        return list(override.sweep_iterator())
    if override.is_sweep_override():
        return []
    return [override.value()]


def _check_values(arg: str, tp: Any) -> None:
    """``arg`` (``key=value``) parsed as Hydra will; each value it sets fits the key's type."""
    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
        values = _values(override)
    except HydraException:
        return  # a syntax error: Hydra's own message names it
    single = not override.is_sweep_override()
    for v in values:  # a single value is quoted as typed (1e3, not 1000.0); a sweep's element as parsed
        _check_value(override.key_or_group, tp, v, arg.split("=", 1)[1] if single else None)


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
    for name in chosen[-1].split(",") if chosen else ["none"]:
        name = name.strip().strip("'\"")
        if name in RECIPES and getattr(RECIPES[name], parts[1]) is None:
            with_it = sorted(n for n, r in RECIPES.items() if getattr(r, parts[1]) is not None)
            raise ConfigError(
                f"invalid config: {key} refines the {parts[1]} spec, but quant={name} quantizes no "
                f"{parts[1]}; first choose a recipe that does (quant={' / '.join(with_it)}), then "
                f"refine it ({key}=...)"
            )


OUTPUT_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")
"""Hydra creates these before the job starts (a traceback where it cannot): checked here first."""


def _check_output_dir(arg: str) -> None:
    """``hydra.run.dir=<dir>`` / ``hydra.sweep.dir=<dir>``: a directory this process can create
    files in (or create), and not an empty path (an unset shell variable: Hydra would put the
    run's files, or a sweep's job folders, straight into the current directory); an interpolated
    value is left to Hydra."""
    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
        value = override.value()
    except HydraException:
        return
    if isinstance(value, str) and not value.strip():
        key = override.key_or_group
        raise ConfigError(
            f"invalid config: {key}= is an empty path (an unset shell variable?), which would put this "
            f"command's outputs straight into the current directory; name the directory ({key}=runs/a), or "
            "leave the key out for Hydra's default under outputs/ or multirun/"
        )
    if isinstance(value, str) and value and "${" not in value:
        check_writable_dir(override.key_or_group, Path(value))


def _given(args: list[str]) -> dict[str, Any]:
    """The plain ``key=value`` overrides of ``args`` as Hydra parses them (``+``/``++`` dropped,
    quotes and escapes resolved); sweeps (``a,b``) and what Hydra cannot parse are left out."""
    out: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
            if not override.is_sweep_override():
                out[override.key_or_group] = override.value()
        except HydraException:
            continue
    return out


def is_sweep_override(arg: str) -> bool:
    """``arg`` gives a key several values (``quant=int8,int4``, ``range(1,4)``, ``choice(...)``):
    one axis of a sweep, which a command running one configuration cannot take."""
    if "=" not in arg or arg.startswith(("-", "~")):
        return False
    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
    except HydraException:
        return False
    return bool(override.is_sweep_override())


def is_multirun(args: list[str]) -> bool:
    """The command line asks for a sweep: ``-m`` / ``--multirun``, a ``sweep=`` preset (they set
    multirun themselves) or ``hydra.mode=MULTIRUN``."""
    return (
        any(a in ("-m", "--multirun") for a in args)
        or any(a.split("=", 1)[0].lstrip("+") == "sweep" for a in args)
        or str(_given(args).get("hydra.mode", "")).upper() == "MULTIRUN"
    )


def check_single_run_values(args: list[str]) -> None:
    """A command line that is not a sweep gives each key one value: ``quant=int8,int4`` without
    ``-m`` is refused naming the fix (Hydra's own answer is a composition error, exit 1)."""
    several = [a for a in args if is_sweep_override(a)]
    if several and not is_multirun(args):
        raise ConfigError(
            f"invalid config: {' '.join(several)} gives several values, which only a sweep runs; add -m "
            f"(python -m experiments.run -m {' '.join(several)} ...) or give one value"
        )


def point_run_dir(cfg: DictConfig, num: int, job_id: object) -> Path:
    """The run directory a sweep point gets: ``hydra.sweep.dir`` / ``hydra.sweep.subdir`` of its
    composed ``cfg`` resolved with the job number and id its launcher sets (the subdir may name
    either: ``${hydra.job.num}`` by default). ``cfg`` itself is left as it is."""
    point = copy.deepcopy(cfg)
    with open_dict(point):
        point.hydra.job.num = num
        point.hydra.job.id = job_id
    return Path(str(point.hydra.sweep.dir)) / str(point.hydra.sweep.subdir)


def check_fresh_outputs(args: list[str]) -> None:
    """Refuse, before Hydra writes its ``.hydra/`` files, a fresh run (no ``resume=true``) whose
    explicit ``hydra.run.dir`` holds an earlier run's records, or a sweep whose explicit
    ``hydra.sweep.dir`` does in one of its job directories (Hydra's default
    ``hydra.sweep.subdir``, the job number): :func:`~.run_dir_checks.check_fresh_run_dir`. A directory
    Hydra names by the time (the default), a custom ``hydra.sweep.subdir`` or an unreadable
    directory are left to the check the runner makes again before each job starts."""
    given = _given(args)
    try:
        if OmegaConf.create({"resume": BooleanNode(value=given.get("resume", False))}).resume is True:
            return  # (any spelling OmegaConf reads as true: yes, 1, True, ...)
    except ValidationError:
        return  # not a boolean: the config validation says so
    sweep = is_multirun(args)
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    value = given.get(key)
    if not isinstance(value, str) or not value or "${" in value or (sweep and "hydra.sweep.subdir" in given):
        return
    ckpt = given.get("train.checkpoint_dir")
    try:
        root = Path(value)
        jobs = [root] if not sweep else [d for d in root.iterdir() if d.is_dir() and d.name.isdigit()]
        for job in sorted(jobs) if root.exists() else []:
            latest = (Path(ckpt) if isinstance(ckpt, str) else job / "checkpoints") / "LATEST"
            check_fresh_run_dir(job, key=key, resumable=latest.is_file())
    except OSError:
        return


_DELETION = re.compile(r"~[A-Za-z_][\w.]*(=|$)")
"""Hydra's deletion override, ``~key`` or ``~key=value`` (not a value such as ``~/conf``)."""


def _check_deletion(arg: str, groups: list[str]) -> None:
    """``~key``: Hydra deletes a config group's choice (``~quant``: the library's defaults), but
    every key of the run's config belongs to its schema and cannot be deleted (Hydra fails
    obscurely); name the key and say how to set it instead."""
    key = arg[1:].split("=", 1)[0]
    if key in groups:
        return
    tp = _check_key(key)  # an unknown key: named, with the closest one
    if _sub_schema(tp) is not None:
        raise ConfigError(
            f"invalid config: {arg} deletes a section, but {key} is part of the run's schema; set its "
            f"keys instead ({key}.<key>=<value>)"
        )
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    raise ConfigError(
        f"invalid config: {arg} deletes a key, but {key} is part of the run's schema and always has a "
        f"value; set it instead: {key}=<value>" + (" (null is one of its values)" if optional else "")
    )


def check_parsable(arg: str) -> None:
    """ConfigError unless Hydra's override grammar reads ``arg``: a value with a character the
    grammar reserves (``zero.nvme_path=~/scratch``, ``train.steps=a=b)(``) is otherwise Hydra's
    lexer message and a link, exit 1, before any of the runner's own checks."""
    try:
        OverridesParser.create().parse_overrides([arg])
    except HydraException as e:
        lines = str(e).strip().splitlines()
        reason, fix = (lines[0] if lines else type(e).__name__), "fix the value"
        lexer = "LexerNoViableAltException: "
        if reason.startswith(lexer) and len(lines) > 1 and lines[1].strip() == "^":
            col = lines[1].index("^") - len(lexer)  # the caret sits under the offending character
            if 0 <= col < len(arg):
                reason = f"{arg[col]!r} at character {col + 1} is not allowed unquoted in a value"
                fix = f"spell the value out without {arg[col]!r}" + (" (the path in full)" if arg[col] == "~" else "")
        raise ConfigError(
            f"invalid config: {arg}: Hydra cannot parse this override ({reason}); {fix}, or quote the "
            f"value for Hydra inside the shell's quotes (\"{arg.split('=', 1)[0]}='...'\")"
        ) from None


def check_overrides(args: list[str]) -> None:
    """Reject a command-line override that Hydra cannot parse, names an unknown group option or
    key, gives a key a value of the wrong type (``train.steps=abc``: an integer is expected), or
    names an output directory (``hydra.run.dir``) this process cannot write to or whose disk is full."""
    groups = config_groups()
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            check_parsable(arg)
        if arg.startswith(OUTPUT_DIR_KEYS) and arg.split("=", 1)[0] in OUTPUT_DIR_KEYS:
            _check_output_dir(arg)
        if _DELETION.match(arg) and not arg.startswith(("~hydra.", "~hydra/")):
            _check_deletion(arg, groups)
            continue
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
                    raise ConfigError(
                        f"invalid config: {key}={v!r} is not a {key} option{hint}; allowed: {', '.join(options)}"
                    )
        else:
            tp = _check_key(key)
            _check_spec_key(key, args)
            _check_values(arg, tp)
