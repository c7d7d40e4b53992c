"""What a quantized collective does to its payload, as one value: :class:`QuantSpec`.

One spec travels unchanged through every layer that quantizes: ``ZeroConfig.weights`` /
``ZeroConfig.grads`` in the runtime, the ``spec=`` argument of the collectives, the FSDP2 and DDP
plug-ins, and the scaling model's byte formulas. A new scheme (Hadamard rotation, weight
differences, fp8, ...) is a new ``scheme`` name registered with :func:`register_scheme` plus its
kernels (see ``zeropp.comm.codecs``); nothing that only carries a spec changes.

Named recipes (:data:`RECIPES`, :meth:`QuantRecipe.from_name`) are the presets the runner's
``quant=`` group offers, in the manner of torchao's float8 recipes: ``int8`` is qwZ INT8,
``w8g4`` INT8 weights + INT4 gradients, ``zeropp`` the paper's full setting (qwZ INT8 + hpZ + qgZ
INT4), and so on. Each is defined here once; the Hydra config group is generated from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

ROUNDINGS = ("nearest", "stochastic")
"""``nearest``: round to the nearest code (deterministic). ``stochastic``: round up with probability
equal to the fractional part (unbiased; QSDP's weight quantizer)."""

_SCHEME_BITS: dict[str, tuple[int, ...]] = {"int": (8, 4)}
"""Registered schemes -> the code widths their kernels implement. ``int`` is ZeRO++'s block-wise
symmetric integer quantization (one fp32 scale per group, ``absmax / qmax``)."""


def register_scheme(name: str, bits: tuple[int, ...]) -> None:
    """Declare a quantization scheme and the bit widths it supports, so ``QuantSpec(scheme=name)``
    validates. To make it *runnable*, register its codec with ``zeropp.comm.codecs.register_codec``
    (which calls this). Re-registering a name replaces it."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a scheme name must be a non-empty string, got {name!r}")
    if not bits or not all(isinstance(b, int) and b > 0 for b in bits):
        raise ValueError(f"scheme {name!r}: bits must be a non-empty tuple of positive ints, got {bits!r}")
    _SCHEME_BITS[name] = tuple(bits)


def unregister_scheme(name: str) -> None:
    """Forget a scheme (tests that register a toy scheme clean up with this); ``int`` stays."""
    if name == "int":
        raise ValueError("the built-in scheme 'int' cannot be unregistered")
    _SCHEME_BITS.pop(name, None)


def schemes() -> dict[str, tuple[int, ...]]:
    """Registered scheme names and their supported bit widths."""
    return dict(_SCHEME_BITS)


_PLAIN_BITS = (None, 16, 32)
"""Widths that mean "not quantized": a plain collective is ``spec=None``, never a spec."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one collective's payload is quantized. Validated on construction; a value, so it can be
    hashed, logged, compared across a sweep and shared by every layer."""

    bits: int
    """Code width of the message (for a gradient reduce-scatter: the cross-node hop). Required, so
    that setting any other field (``zero.weights.group_size=256`` on the command line) never
    switches quantization on at a width nobody chose."""

    group_size: Optional[int] = None
    """Elements per fp32 scale; None = the kernel default for the use (512 for weights, 128 for
    gradients). Any positive size works (rows are padded); INT4 needs an even size."""

    rounding: str = "nearest"
    """``nearest`` or ``stochastic`` (unbiased; every rank and call draws different, reproducible
    noise from ``seed``)."""

    intra_bits: Optional[int] = None
    """Reduce-scatter only: code width of the intra-node hop (SDP4Bit's 8 inside / 4 across);
    None = ``bits``. Meaningless for an all-gather, which has one hop."""

    error_feedback: bool = False
    """Reduce-scatter only: keep each rank's quantization residual and add it to its next
    gradient (LoCo-style error feedback)."""

    seed: int = 0
    """Base seed of stochastic rounding, an int in [0, 2**63); ignored for ``nearest``."""

    scheme: str = "int"
    """Registered quantization scheme (:func:`schemes`); ``int`` = block-wise symmetric integer."""

    def __post_init__(self) -> None:
        if self.scheme not in _SCHEME_BITS:
            raise ValueError(f"QuantSpec.scheme={self.scheme!r} is not registered; use one of {sorted(_SCHEME_BITS)}")
        allowed = _SCHEME_BITS[self.scheme]
        if self.bits in _PLAIN_BITS:
            raise ValueError(
                f"QuantSpec.bits={self.bits!r} means no quantization; pass spec=None for the plain "
                f"collective, or bits in {allowed} to quantize"
            )
        if self.intra_bits in (16, 32):
            raise ValueError(
                f"QuantSpec.intra_bits={self.intra_bits} asks for an unquantized intra-node hop, which qgZ "
                f"does not have (its intra-node hop is quantized); use intra_bits=None (= bits={self.bits}) "
                f"or one of {allowed}"
            )
        for name in ("bits", "intra_bits"):
            v = getattr(self, name)
            if name == "intra_bits" and v is None:
                continue
            if not _is_int(v) or v not in allowed:
                raise ValueError(
                    f"QuantSpec.{name}={v!r} is not supported by scheme {self.scheme!r}; use one of {allowed}"
                )
        gs = self.group_size
        if gs is not None:
            if not _is_int(gs) or gs < 1:
                raise ValueError(f"QuantSpec.group_size must be a positive int or None, got {gs!r}")
            if gs % 2 and 4 in (self.bits, self.intra_bits):
                raise ValueError(
                    f"QuantSpec.group_size={gs} is odd; INT4 packs two codes per byte, so use an even size"
                )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"QuantSpec.rounding={self.rounding!r}; use one of {ROUNDINGS}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"QuantSpec.error_feedback must be True or False, got {self.error_feedback!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"QuantSpec.seed must be an int in [0, 2**63), got {self.seed!r}")

    @property
    def stochastic(self) -> bool:
        """True when rounding is stochastic."""
        return self.rounding == "stochastic"

    @property
    def hop_bits(self) -> tuple[int, int]:
        """(intra-node hop bits, cross-node hop bits) of a hierarchical reduce-scatter."""
        return (self.bits if self.intra_bits is None else self.intra_bits, self.bits)

    def replace(self, **changes: object) -> "QuantSpec":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """Short text for tables: ``int8``, ``int8/4`` (intra/cross), ``+sr`` stochastic, ``+ef``."""
        intra, cross = self.hop_bits
        s = f"{self.scheme}{cross}" if intra == cross else f"{self.scheme}{intra}/{cross}"
        if self.group_size is not None:
            s += f"g{self.group_size}"
        if self.stochastic:
            s += "+sr"
        if self.error_feedback:
            s += "+ef"
        return s


@dataclass(frozen=True, kw_only=True)
class QuantRecipe:
    """A named ZeRO++ communication setting: what the weight gathers and the gradient
    reduce-scatters quantize, and whether hpZ's secondary partition is on."""

    weights: Optional[QuantSpec] = None
    """qwZ: the spec of the stage-3 parameter all-gathers; None = full precision."""
    grads: Optional[QuantSpec] = None
    """qgZ: the spec of the gradient reduce-scatters; None = full precision."""
    hpz: bool = False
    """hpZ: keep an intra-node secondary weight partition so backward gathers stay in the node."""

    @classmethod
    def from_name(cls, name: str) -> "QuantRecipe":
        """The recipe called ``name`` in :data:`RECIPES`."""
        if name not in RECIPES:
            raise ValueError(f"unknown quantization recipe {name!r}; choose one of {sorted(RECIPES)}")
        return RECIPES[name]


RECIPES: dict[str, QuantRecipe] = {
    "none": QuantRecipe(),
    "int8": QuantRecipe(weights=QuantSpec(bits=8)),
    "int4": QuantRecipe(weights=QuantSpec(bits=4)),
    "qwz": QuantRecipe(weights=QuantSpec(bits=8)),
    "hpz": QuantRecipe(hpz=True),
    "qgz": QuantRecipe(grads=QuantSpec(bits=4)),
    "w8g8": QuantRecipe(weights=QuantSpec(bits=8), grads=QuantSpec(bits=8)),
    "w8g4": QuantRecipe(weights=QuantSpec(bits=8), grads=QuantSpec(bits=4)),
    "w4g4": QuantRecipe(weights=QuantSpec(bits=4), grads=QuantSpec(bits=4)),
    "zeropp": QuantRecipe(weights=QuantSpec(bits=8), grads=QuantSpec(bits=4), hpz=True),
}
"""The named recipes (the runner's ``quant=`` options): ``int8``/``int4``/``qwz`` weights only,
``qgz`` gradients only (INT4), ``hpz`` hierarchical partitioning only, ``w8g8``/``w8g4``/``w4g4``
weights + gradients, ``zeropp`` qwZ INT8 + hpZ + qgZ INT4 (the ZeRO++ paper's setting)."""
