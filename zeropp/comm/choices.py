"""Fixed-choice settings as ``str`` enums, declared once: the base class and the communication ones.

A setting with a fixed set of values (``QuantSpec.rounding``, ``ZeroConfig.precision``, the
offload tiers, ...) is a :class:`StrChoice` subclass. Why ``str`` enums rather than plain tuples
of strings:

- the runner's Hydra schema types the key with the enum, so OmegaConf refuses a typo while
  composing and lists the valid values (OmegaConf matches and lists enum *member names*, which is
  why every member is named exactly as its value: ``fp32 = "fp32"``);
- a member *is* its string: it compares equal to, hashes like, prints, formats and JSON-encodes as
  the value, so existing comparisons (``precision == "fp16"``), dict keys, labels, JSON summaries
  and checkpoint metadata are unchanged. ``repr`` is the value's too, so a config's ``repr`` (kept
  in checkpoint metadata) reads as before. :func:`plain` turns members back into ``str`` for
  writers that check exact types (``yaml.safe_dump``).

``enum.StrEnum`` would do most of this but needs Python 3.11 (the project supports 3.10).

The runtime's choices (precision, offload and memory tiers, frozen storage, LR schedule) are in
``zeropp.runtime.choices``.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

__all__ = ["Fp6Format", "Fp8Format", "MxScale", "Rotation", "Rounding", "StrChoice", "plain"]

C = TypeVar("C", bound="StrChoice")


class StrChoice(str, enum.Enum):
    """A ``str`` enum whose members print, format and ``repr`` as their value (module docstring)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The valid values as plain strings, in declaration order."""
        return tuple(str(m.value) for m in cls)

    @classmethod
    def parse(cls: type[C], value: Any, key: str) -> C:
        """``value`` (a member or its string) as a member; a ValueError naming ``key`` and the
        valid values otherwise (the config classes call this in ``__post_init__``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{key} must be one of {', '.join(cls.values())}; got {value!r}")


class Rounding(StrChoice):
    """How a quantizer rounds (``QuantSpec.rounding``)."""

    nearest = "nearest"
    """Round to the nearest code (deterministic)."""
    stochastic = "stochastic"
    """Round up with probability equal to the fractional part (unbiased; QSDP's weight quantizer)."""


class Rotation(StrChoice):
    """The basis a quantizer works in (``QuantSpec.rotation``)."""

    none = "none"
    """Quantize the values as they are."""
    hadamard = "hadamard"
    """Quantize them in a blockwise Walsh-Hadamard-rotated basis (SDP4Bit) and rotate back after
    dequantizing."""


class Fp8Format(StrChoice):
    """The 8-bit float element of the ``fp8`` scheme and of MXFP8 (``QuantSpec.fp8_format``)."""

    e4m3 = "e4m3"
    """4 exponent bits, 3 mantissa bits, max 448: more precision (weights, activations)."""
    e5m2 = "e5m2"
    """5 exponent bits, 2 mantissa bits, max 57344: more range (gradients)."""


class Fp6Format(StrChoice):
    """The 6-bit float element of MXFP6 (``QuantSpec.fp6_format``)."""

    e2m3 = "e2m3"
    """2 exponent bits, 3 mantissa bits, max 7.5: more precision."""
    e3m2 = "e3m2"
    """3 exponent bits, 2 mantissa bits, max 28: more range."""


class MxScale(StrChoice):
    """How an MX block's shared power-of-two scale is chosen (``QuantSpec.mx_scale``)."""

    ocp = "ocp"
    """OCP MX v1.0: ``2**(floor(log2 absmax) - emax)``; the block's largest elements may saturate."""
    round_up = "round_up"
    """The smallest power of two with ``absmax / scale <= max``: nothing saturates (the rule of
    the MXFP8 training recipes)."""


def plain(obj: Any) -> Any:
    """``obj`` with every :class:`StrChoice` member (in dicts, lists, tuples, keys too) replaced by
    its plain ``str`` value; anything else as it is."""
    if isinstance(obj, StrChoice):
        return str(obj.value)
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj
