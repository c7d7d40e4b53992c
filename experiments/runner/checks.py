"""The harness's named choices and the checks every config section uses.

The ``StrChoice`` enums of the harness's option names (:class:`DataKind`,
:class:`LoggerName`, ...: the same kind of choice the library declares in ``zeropp.comm.choices``),
:class:`ConfigError`, and the checks that word every config error the same way: :func:`check`,
:func:`choice`, :func:`pos_int`, :func:`unused` (a key the chosen option does not read must stay
at its default, so nothing is silently ignored), with the limits they share. The sections
themselves are ``sections.py``.
"""

from __future__ import annotations

from typing import Any

from zeropp.comm.choices import StrChoice


class DataKind(StrChoice):
    """``data.kind``."""

    text = "text"
    random = "random"


class DataSource(StrChoice):
    """``data.source`` (text only)."""

    python_stdlib = "python_stdlib"
    path = "path"


class LoggerName(StrChoice):
    """``logger.name``."""

    wandb = "wandb"
    none = "none"


class LoggerMode(StrChoice):
    """``logger.mode`` (wandb's)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


class ClusterName(StrChoice):
    """``cluster.name``."""

    local = "local"
    emulated = "emulated"


class LauncherDevice(StrChoice):
    """``launcher.device``."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and what is allowed."""


def check(cond: bool, key: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` ``invalid config: key=value; allowed: ...`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"invalid config: {key}={value!r}; allowed: {allowed}")


def choice(obj: Any, name: str, choices: type[StrChoice], key: str, allowed: str | None = None) -> None:
    """Field ``name`` of frozen ``obj`` must be one of ``choices`` (a member or its string), else
    :class:`ConfigError` as :func:`check` words it; it is stored as the member."""
    value = getattr(obj, name)
    ok = isinstance(value, str) and value in choices.values()
    check(ok, key, value, allowed if allowed is not None else ", ".join(choices.values()))
    object.__setattr__(obj, name, choices(value))


def pos_int(key: str, value: Any, minimum: int = 1) -> None:
    """``value`` is an int (not a bool) >= ``minimum``, else :class:`ConfigError`."""
    check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        key,
        value,
        f"an integer >= {minimum}",
    )


def unused(key: str, value: Any, default: Any, because: str, fix: str) -> None:
    """A key the chosen setting does not read must stay at its default (nothing is silently ignored)."""
    if value != default:
        raise ConfigError(f"invalid config: {key}={value!r} does nothing with {because}; {fix}")


MIN_CORPUS_BYTES = 4096
"""Fewest corpus bytes a text run accepts (``data.read_corpus`` refuses less)."""


MAX_SECONDS = 1e9
"""Longest time setting (about 31 years): the process group's timeout becomes a ``datetime.timedelta``,
which overflows near 8.6e13 s, so a larger value is a slip that would crash every rank."""


SEED_LIMIT = 2**32
"""``train.seed`` is below this: the data order seeds torch generators with ``seed x 1,000,003 +
rank``, which must stay a 64-bit integer; 2**32 keeps that true for any world size."""
