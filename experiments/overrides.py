"""Command-line pre-check: clearer answers than Hydra's for the common slips.

Hydra refuses ``quant=int9`` or ``quantt=int8`` too, but buries the answer under its config search
path; :func:`check_overrides` runs before Hydra and names the override, the allowed values and
the closest match, then the runner exits 2 without starting anything.
"""

from __future__ import annotations

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
