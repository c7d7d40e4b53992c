"""Command-line pre-check: clearer answers than Hydra's for the common slips.

Hydra refuses ``quant=int9`` or ``quantt=int8`` too, but buries the answer under its config search
path; :func:`check_overrides` runs before Hydra and names the override, the allowed values and
the closest match, then the runner exits 2 without starting anything.
"""

from __future__ import annotations

import dataclasses
import difflib

from .config import SECTIONS, CONF_DIR, ConfigError


def group_options(group: str) -> list[str]:
    """Option names of a config group (the yaml files in ``conf/<group>/``)."""
    d = CONF_DIR / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def config_groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))


def check_overrides(args: list[str]) -> None:
    """Reject a command-line override that names an unknown group option or top-level key.

    Hydra would also refuse these, but buries the answer under its search path; this names the
    override, the allowed values, and the closest match. Everything else is left to Hydra and
    :func:`from_omegaconf`.
    """
    groups = config_groups()
    keys = set(groups) | set(SECTIONS) | {"stage"}
    for arg in args:
        if arg.startswith(("-", "+", "~", "hydra.", "hydra/")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        top = key.split(".", 1)[0].split("/", 1)[0]
        if top not in keys:
            near = difflib.get_close_matches(top, sorted(keys), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown config key {key!r} in {arg!r}{hint}; config groups: "
                              f"{', '.join(groups)}; keys: stage, {', '.join(SECTIONS)}")
        if key in groups:
            options = group_options(key)
            for v in value.split(","):
                v = v.strip().strip("'\"")
                if v and v != "null" and v not in options and not v.startswith(("range(", "choice(", "glob(")):
                    near = difflib.get_close_matches(v, options, n=1)
                    hint = f" (did you mean {key}={near[0]}?)" if near else ""
                    raise ConfigError(f"invalid config: {key}={v!r} is not a {key} preset{hint}; "
                                      f"allowed: {', '.join(options)}")
        elif "." in key and not arg.startswith("+"):
            _check_subkey(key, top, args, groups)


def _option_keys(group: str, option: str) -> set[str] | None:
    """Top-level keys of ``conf/<group>/<option>.yaml`` (None if it is packaged elsewhere)."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None
    text = path.read_text()
    if "# @package" in text:
        return None
    from omegaconf import OmegaConf

    return set(OmegaConf.load(path).keys())


def _selected_option(group: str, args: list[str]) -> str | None:
    """The option of ``group`` this command line uses: its ``group=...`` override, else the default."""
    for arg in args:
        if arg.startswith(f"{group}="):
            return arg.split("=", 1)[1].split(",")[0].strip().strip("'\"")
    from omegaconf import OmegaConf

    for entry in OmegaConf.load(CONF_DIR / "config.yaml").get("defaults", []):
        if isinstance(entry, str) or group not in entry:
            continue
        return str(entry[group])
    return None


def _check_subkey(key: str, top: str, args: list[str], groups: list[str]) -> None:
    """``section.key=value``: the key must be a field of the section and, for a section chosen
    from a config group, a key of the chosen option (Hydra's "not in struct" otherwise)."""
    sub = key.split(".")[1]
    cls = SECTIONS.get(top)
    if cls is not None:
        fields = [f.name for f in dataclasses.fields(cls)]
        if sub not in fields:
            near = difflib.get_close_matches(sub, fields, n=1)
            hint = f" (did you mean {top}.{near[0]}?)" if near else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; {top} keys: {', '.join(fields)}")
    if top not in groups:
        return
    option = _selected_option(top, args)
    keys = _option_keys(top, option) if option else None
    if keys is None or sub in keys:
        return
    owners = [o for o in group_options(top) if sub in (_option_keys(top, o) or set())]
    where = f"; it is a key of {top}={' / '.join(owners)} (add {top}={owners[0]})" if owners else ""
    raise ConfigError(f"invalid config: {key} does not apply to {top}={option}{where}; "
                      f"{top}={option} keys: {', '.join(sorted(keys))}")

