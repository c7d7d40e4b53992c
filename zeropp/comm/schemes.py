"""The registry of quantization schemes: which scheme names :class:`~.spec.QuantSpec` accepts,
at which code widths, with which fixed block size and which format fields. The built-in schemes
are the kernels of ``zeropp.kernels``; ``zeropp.comm.codecs.register_codec`` adds others through
:func:`register_scheme`. ``zeropp.comm.spec`` re-exports every public name here.
"""

from __future__ import annotations

from typing import Optional

from zeropp.kernels.format_layout import FIXED_GROUP_SIZE
from zeropp.kernels.layout import MAX_GROUP_SIZE

from .choices import Fp6Format, Fp8Format, MxScale, StrChoice

_SCHEME_BITS: dict[str, tuple[int, ...]] = {"int": (8, 4), "fp8": (8,), "mx": (8, 6, 4), "mxint": (8,), "nvfp4": (4,)}
"""Registered schemes -> the code widths their kernels implement. Built in (``zeropp.kernels``):
``int``, ZeRO++'s block-wise symmetric integer quantization (one fp32 scale per group,
``absmax / qmax``); ``fp8``, E4M3 / E5M2 elements with one fp32 scale per group; ``mx``, the OCP
microscaling formats (blocks of 32 sharing a power-of-two E8M0 scale: MXFP8 at 8 bits, MXFP6 at
6, MXFP4 at 4); ``mxint``, MXINT8; ``nvfp4``, E2M1 elements with an E4M3 scale per 16 and an fp32
scale per message row."""

BUILTIN_SCHEMES = tuple(_SCHEME_BITS)
"""Schemes whose kernels ship with zeropp; they cannot be replaced or unregistered."""

_FIXED_GROUP_SIZE: dict[str, int] = {
    "mx": FIXED_GROUP_SIZE["mx"],
    "mxint": FIXED_GROUP_SIZE["mx"],
    "nvfp4": FIXED_GROUP_SIZE["nvfp4"],
}
"""Schemes whose block size the format fixes: ``QuantSpec.group_size`` must be it (None means it)."""

_SCHEME_FIELDS: dict[str, dict[str, tuple[int, ...]]] = {
    "fp8": {"fp8_format": (8,)},
    "mx": {"fp8_format": (8,), "fp6_format": (6,), "mx_scale": (8, 6, 4)},
    "mxint": {"mx_scale": (8,)},
}
"""Scheme -> the format fields of :class:`QuantSpec` it reads, and at which code widths."""

_FORMAT_CHOICES: dict[str, type[StrChoice]] = {"fp8_format": Fp8Format, "fp6_format": Fp6Format, "mx_scale": MxScale}
"""The element / scale-rule fields of :class:`QuantSpec` and their choices (the first is the default).
A non-default value that the spec's scheme and widths do not read is refused, never ignored."""


def register_scheme(
    name: str,
    bits: tuple[int, ...],
    *,
    group_size: Optional[int] = None,
    fields: Optional[dict[str, tuple[int, ...]]] = None,
) -> None:
    """Declare a quantization scheme and the bit widths it supports, so ``QuantSpec(scheme=name)``
    validates. ``group_size``: the block size when the format fixes it (None: any);
    ``fields``: which format fields of :class:`QuantSpec` (``fp8_format``, ``fp6_format``,
    ``mx_scale``) it reads at which widths. To make it *runnable*, register its codec with
    ``zeropp.comm.codecs.register_codec`` (which calls this). Re-registering a name replaces it;
    the built-in schemes cannot be replaced."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a scheme name must be a non-empty string, got {name!r}")
    if name in BUILTIN_SCHEMES:
        raise ValueError(f"the built-in scheme {name!r} cannot be replaced; register the codec under a new name")
    if not bits or not all(isinstance(b, int) and b > 0 for b in bits):
        raise ValueError(f"scheme {name!r}: bits must be a non-empty tuple of positive ints, got {bits!r}")
    if group_size is not None and (not _is_int(group_size) or not 0 < group_size <= MAX_GROUP_SIZE):
        raise ValueError(f"scheme {name!r}: group_size must be None or an int in [1, {MAX_GROUP_SIZE}]")
    unknown = sorted(set(fields or {}) - set(_FORMAT_CHOICES))
    if unknown:
        raise ValueError(f"scheme {name!r}: fields {unknown} are not QuantSpec format fields {tuple(_FORMAT_CHOICES)}")
    _SCHEME_BITS[name] = tuple(bits)
    _forget_extras(name)
    if group_size is not None:
        _FIXED_GROUP_SIZE[name] = group_size
    if fields:
        _SCHEME_FIELDS[name] = {k: tuple(v) for k, v in fields.items()}


def _forget_extras(name: str) -> None:
    """Drop what register_scheme noted about ``name`` besides its widths."""
    _FIXED_GROUP_SIZE.pop(name, None)
    _SCHEME_FIELDS.pop(name, None)


def unregister_scheme(name: str) -> None:
    """Forget a scheme (tests that register a toy scheme clean up with this); built-ins stay."""
    if name in BUILTIN_SCHEMES:
        raise ValueError(f"the built-in scheme {name!r} cannot be unregistered")
    _SCHEME_BITS.pop(name, None)
    _forget_extras(name)


def fixed_group_size(scheme: str) -> Optional[int]:
    """The block size ``scheme``'s format fixes (mx: 32, nvfp4: 16), None when any size works."""
    return _FIXED_GROUP_SIZE.get(scheme)


def schemes() -> dict[str, tuple[int, ...]]:
    """Registered scheme names and their supported bit widths."""
    return dict(_SCHEME_BITS)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
