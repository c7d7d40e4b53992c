"""What a quantized collective does to its payload, as one value: :class:`QuantSpec`.

One spec travels unchanged through every layer that quantizes: ``ZeroConfig.weights`` /
``ZeroConfig.grads`` in the runtime, the ``spec=`` argument of the collectives, the FSDP2 and DDP
plug-ins, and the scaling model's byte formulas. Hadamard rotation is a spec option
(``rotation``) of every scheme. A new scheme (weight differences, ...) is a new
``scheme`` name registered with :func:`register_scheme` plus its
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

# The kernels' bounds, checked when a spec is built (the largest quantization block and the largest
# rotation block: one block is one GPU program's tile).
from zeropp.kernels.layout import MAX_GROUP_SIZE
from zeropp.kernels.reference import MAX_HADAMARD_BLOCK

from .choices import Fp6Format, Fp8Format, MxScale, Rotation, Rounding
from .schemes import (
    _FIXED_GROUP_SIZE,
    _FORMAT_CHOICES,
    _SCHEME_BITS,
    _SCHEME_FIELDS,
    BUILTIN_SCHEMES,
    _is_int,
    fixed_group_size,
    register_scheme,
    schemes,
    unregister_scheme,
)

__all__ = [
    "BUILTIN_SCHEMES",
    "RECIPES",
    "ROTATIONS",
    "ROUNDINGS",
    "QuantRecipe",
    "QuantSpec",
    "check_rotation_block",
    "fixed_group_size",
    "register_scheme",
    "schemes",
    "unregister_scheme",
]

ROUNDINGS = Rounding.values()
"""``nearest``: round to the nearest code (deterministic). ``stochastic``: round up with probability
equal to the fractional part (unbiased; QSDP's weight quantizer). See :class:`~.choices.Rounding`."""

ROTATIONS = Rotation.values()
"""``none``: quantize the values as they are. ``hadamard``: quantize them in a blockwise
Walsh-Hadamard-rotated basis (SDP4Bit) and rotate back after dequantizing; see
``QuantSpec.rotation`` and :class:`~.choices.Rotation`."""

_PLAIN_BITS = (None, 16, 32)
"""Widths that mean "not quantized": a plain collective is ``spec=None``, never a spec."""


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

    rounding: Rounding = Rounding.nearest
    """``nearest`` or ``stochastic`` (a :class:`~.choices.Rounding`; a plain string is accepted and
    stored as its member) (unbiased; every rank and call draws different, reproducible
    noise from ``seed``)."""

    intra_bits: Optional[int] = None
    """Reduce-scatter only: code width of the intra-node hop (SDP4Bit's 8 inside / 4 across);
    None = ``bits``. Meaningless for an all-gather, which has one hop."""

    error_feedback: bool = False
    """Reduce-scatter only: keep the residual of every quantization round this rank performs
    (qgZ's first hop and its re-quantization of node sums) and add it to the next value of that
    round (LoCo-style error feedback; ``zeropp.comm.feedback``)."""

    residual_bits: int = 8
    """With ``error_feedback``: how residuals are stored, 8 (LoCo: INT8 codes and one fp32 scale
    per 128 elements, about 1 byte per element) or 32 (fp32). Any other value, or 32 without
    ``error_feedback``, is refused."""

    seed: int = 0
    """Base seed of stochastic rounding, an int in [0, 2**63); ignored for ``nearest``."""

    scheme: str = "int"
    """Registered quantization scheme (:func:`schemes`); ``int`` = block-wise symmetric integer."""

    rotation: Rotation = Rotation.none
    """``none`` or ``hadamard`` (a :class:`~.choices.Rotation`; a plain string is accepted and stored
    as its member). ``hadamard``: rotate each block of ``hadamard_block`` elements by the normalised
    Walsh-Hadamard matrix before quantizing and rotate back after dequantizing (SDP4Bit). The
    rotation spreads an outlier over its block, so the block's scale no longer flattens its
    neighbours to zero. Used by qwZ and by both qgZ hops (qgZ sums and re-quantizes in the
    rotated basis, see ``zeropp.comm.codecs.HadamardCodec``); the bytes on the wire are those of
    ``none``. Every scheme; the block must divide the group size (mx: 32, nvfp4: 16)."""

    hadamard_block: Optional[int] = None
    """Elements per rotation block, a power of two dividing ``group_size`` (so every quantization
    group holds whole blocks and a rotated row needs no extra group); None = the group size
    (which then must be a power of two). Only with ``rotation="hadamard"``. With ``group_size=None``
    the block is checked against the use's default group size when the collective runs."""

    fp8_format: Fp8Format = Fp8Format.e4m3
    """The 8-bit element of schemes ``fp8`` and ``mx`` (MXFP8): ``e4m3`` (max 448, 3 mantissa bits)
    or ``e5m2`` (max 57344, 2 mantissa bits). Refused when set for a scheme or widths that do not
    read it."""

    fp6_format: Fp6Format = Fp6Format.e2m3
    """The 6-bit element of scheme ``mx`` (MXFP6): ``e2m3`` (max 7.5) or ``e3m2`` (max 28)."""

    mx_scale: MxScale = MxScale.ocp
    """How schemes ``mx`` / ``mxint`` choose a block's power-of-two scale: ``ocp`` (OCP MX v1.0,
    ``2**(floor(log2 absmax) - emax)``, the largest elements may saturate) or ``round_up`` (the
    smallest power of two under which nothing saturates, as MXFP8 training recipes do)."""

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
        fixed = _FIXED_GROUP_SIZE.get(self.scheme)
        if fixed is not None:
            if self.group_size is not None and self.group_size != fixed:
                raise ValueError(
                    f"QuantSpec.group_size={self.group_size!r}: scheme {self.scheme!r} has blocks of {fixed} "
                    f"elements fixed by its format; use group_size={fixed} or None"
                )
            object.__setattr__(self, "group_size", fixed)
        gs = self.group_size
        if gs is not None:
            if not _is_int(gs) or gs < 1:
                raise ValueError(f"QuantSpec.group_size must be a positive int or None, got {gs!r}")
            if gs > MAX_GROUP_SIZE:
                raise ValueError(
                    f"QuantSpec.group_size={gs} is larger than the quantization kernels' largest block, "
                    f"{MAX_GROUP_SIZE} elements (one block is one GPU program's tile); use QuantSpec.group_size "
                    f"<= {MAX_GROUP_SIZE}"
                )
            if gs % 2 and 4 in (self.bits, self.intra_bits):
                raise ValueError(
                    f"QuantSpec.group_size={gs} is odd; INT4 packs two codes per byte, so use an even size"
                )
        if not isinstance(self.rounding, str) or self.rounding not in ROUNDINGS:
            raise ValueError(f"QuantSpec.rounding={self.rounding!r}; use one of {ROUNDINGS}")
        object.__setattr__(self, "rounding", Rounding(self.rounding))
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"QuantSpec.error_feedback must be True or False, got {self.error_feedback!r}")
        if isinstance(self.residual_bits, bool) or self.residual_bits not in (8, 32):
            raise ValueError(
                f"QuantSpec.residual_bits={self.residual_bits!r}: error-feedback residuals are stored in "
                f"8 bits (INT8 + scales, LoCo) or 32 (fp32); use 8 or 32"
            )
        if self.residual_bits != 8 and not self.error_feedback:
            raise ValueError(
                f"QuantSpec.residual_bits={self.residual_bits} does nothing without error feedback; set "
                f"error_feedback=True to keep residuals, or leave residual_bits=8"
            )
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"QuantSpec.seed must be an int in [0, 2**63), got {self.seed!r}")
        self._check_formats()
        self._check_rotation()

    def _check_formats(self) -> None:
        """Parse the format fields; refuse a non-default one that this scheme at these widths
        does not read (it would be silently ignored)."""
        uses = _SCHEME_FIELDS.get(self.scheme, {})
        for name, choice in _FORMAT_CHOICES.items():
            value = choice.parse(getattr(self, name), f"QuantSpec.{name}")
            object.__setattr__(self, name, value)
            default = next(iter(choice))
            if value != default and not set(uses.get(name, ())) & set(self.hop_bits):
                readers = [
                    f"{sc} at bits {'/'.join(map(str, fl[name]))}" for sc, fl in _SCHEME_FIELDS.items() if name in fl
                ]
                raise ValueError(
                    f"QuantSpec.{name}={value} does nothing for scheme {self.scheme!r} at bits "
                    f"{'/'.join(map(str, sorted(set(self.hop_bits))))}; it applies to {', '.join(readers)}. "
                    f"Leave it at {default} or choose such a scheme"
                )

    def _check_rotation(self) -> None:
        if not isinstance(self.rotation, str) or self.rotation not in ROTATIONS:
            raise ValueError(f"QuantSpec.rotation={self.rotation!r}; use one of {ROTATIONS}")
        object.__setattr__(self, "rotation", Rotation(self.rotation))
        hb = self.hadamard_block
        if self.rotation == "none":
            if hb is not None:
                raise ValueError(
                    f"QuantSpec.hadamard_block={hb!r} is set but rotation='none'; set "
                    "rotation='hadamard' to rotate, or leave hadamard_block=None"
                )
            return
        if hb is not None and (not _is_int(hb) or hb < 2 or hb & (hb - 1) or hb > MAX_HADAMARD_BLOCK):
            raise ValueError(
                f"QuantSpec.hadamard_block={hb!r} must be a power of two in [2, {MAX_HADAMARD_BLOCK}] "
                "(e.g. 32, 64, 128), or None for the group size"
            )
        check_rotation_block(self.hadamard_block, self.group_size)

    def rotation_block(self, group_size: int) -> Optional[int]:
        """The rotation block for a use whose group size is ``group_size`` (the spec's own, or the
        use's default when ``self.group_size`` is None); None without rotation."""
        if self.rotation == "none":
            return None
        return check_rotation_block(self.hadamard_block, group_size)

    @property
    def stochastic(self) -> bool:
        """True when rounding is stochastic."""
        return self.rounding == "stochastic"

    @property
    def hop_bits(self) -> tuple[int, int]:
        """(intra-node hop bits, cross-node hop bits) of a hierarchical reduce-scatter."""
        return (self.bits if self.intra_bits is None else self.intra_bits, self.bits)

    def replace(self, **changes: object) -> QuantSpec:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """Short text for tables: ``int8``, ``int8/4`` (intra/cross), ``mxfp8/4``, ``fp8+e5m2`` (a
        non-default element or scale rule), ``+sr`` stochastic, ``+ef``. The MX float formats are
        named as the recipes (``quant=mxfp8``) and the benchmarks' format names call them: MXFP8,
        MXFP6, MXFP4 in the OCP spec's words, beside ``mxint8``."""
        intra, cross = self.hop_bits
        stem = "mxfp" if self.scheme == "mx" else self.scheme
        if self.scheme[-1:].isdigit():  # fp8, nvfp4: the name carries the width
            s = self.scheme
        else:
            s = f"{stem}{cross}" if intra == cross else f"{stem}{intra}/{cross}"
        if self.group_size is not None and self.scheme not in _FIXED_GROUP_SIZE:
            s += f"g{self.group_size}"
        uses = _SCHEME_FIELDS.get(self.scheme, {})
        for name, choice in _FORMAT_CHOICES.items():
            value = getattr(self, name)
            if set(uses.get(name, ())) & {intra, cross} and value != next(iter(choice)):
                s += f"+{value}"
        if self.stochastic:
            s += "+sr"
        if self.error_feedback:
            s += "+ef" if self.residual_bits == 8 else f"+ef{self.residual_bits}"
        if self.rotation == "hadamard":
            s += "+had" if self.hadamard_block is None else f"+had{self.hadamard_block}"
        return s


def check_rotation_block(block: Optional[int], group_size: Optional[int]) -> Optional[int]:
    """The Hadamard block used with ``group_size`` (``block``, or the group size when None),
    checked: a power of two that divides the group size. Returns it (None when ``group_size`` is
    None and no block is set: resolved later against the use's default group size)."""
    if group_size is None:
        return block
    b = group_size if block is None else block
    if b < 2 or b & (b - 1) or b > MAX_HADAMARD_BLOCK:
        raise ValueError(
            f"QuantSpec.rotation='hadamard' rotates blocks of hadamard_block=None -> group_size={group_size} "
            f"elements, which is not a power of two in [2, {MAX_HADAMARD_BLOCK}]; set hadamard_block to a "
            f"power of two dividing {group_size} (e.g. {_pow2_divisor(group_size)}), or group_size to a power of two"
        )
    if group_size % b:
        raise ValueError(
            f"QuantSpec.hadamard_block={b} does not divide group_size={group_size}: each quantization group must "
            f"hold whole rotation blocks (so a rotated row needs no extra scale); use hadamard_block="
            f"{_pow2_divisor(group_size)} (or any power of two dividing {group_size}), or a group_size that is a "
            f"multiple of {b}"
        )
    return b


def _pow2_divisor(n: int) -> str:
    """A hint: the largest power of two >= 2 dividing ``n`` (capped at MAX_HADAMARD_BLOCK)."""
    d = min(n & -n, MAX_HADAMARD_BLOCK)
    return str(d) if d >= 2 else "none for an odd group size: use an even group_size"


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
    weight_diff: Optional[QuantSpec] = None
    """qWD: the spec of the weight-difference refresh after each step (stages 1-2: the parameter
    all-gather; stage 3: hpZ's secondary refresh); None = send the weights themselves."""

    @classmethod
    def from_name(cls, name: str) -> QuantRecipe:
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
    "w4g4h": QuantRecipe(weights=QuantSpec(bits=4), grads=QuantSpec(bits=4, rotation=Rotation.hadamard)),
    "zeropp": QuantRecipe(weights=QuantSpec(bits=8), grads=QuantSpec(bits=4), hpz=True),
    "qwd": QuantRecipe(weight_diff=QuantSpec(bits=4), hpz=True),
    "sdp4bit": QuantRecipe(
        weights=QuantSpec(bits=4),
        grads=QuantSpec(bits=4, rotation=Rotation.hadamard, error_feedback=True),
        weight_diff=QuantSpec(bits=4),
        hpz=True,
    ),
    "fp8": QuantRecipe(
        weights=QuantSpec(scheme="fp8", bits=8), grads=QuantSpec(scheme="fp8", bits=8, fp8_format=Fp8Format.e5m2)
    ),
    "mxfp8": QuantRecipe(
        weights=QuantSpec(scheme="mx", bits=8, mx_scale=MxScale.round_up),
        grads=QuantSpec(scheme="mx", bits=8, mx_scale=MxScale.round_up),
    ),
    "mxfp6": QuantRecipe(
        weights=QuantSpec(scheme="mx", bits=6), grads=QuantSpec(scheme="mx", bits=6, fp6_format=Fp6Format.e3m2)
    ),
    "mxfp4": QuantRecipe(weights=QuantSpec(scheme="mx", bits=4), grads=QuantSpec(scheme="mx", bits=4)),
    "mxint8": QuantRecipe(weights=QuantSpec(scheme="mxint", bits=8), grads=QuantSpec(scheme="mxint", bits=8)),
    "nvfp4": QuantRecipe(weights=QuantSpec(scheme="nvfp4", bits=4), grads=QuantSpec(scheme="nvfp4", bits=4)),
    "w_mxfp8_g_mxfp4": QuantRecipe(
        weights=QuantSpec(scheme="mx", bits=8), grads=QuantSpec(scheme="mx", bits=4, intra_bits=8)
    ),
    "sdp4bit_mx": QuantRecipe(
        weights=QuantSpec(scheme="mx", bits=4),
        grads=QuantSpec(scheme="mx", bits=4, rotation=Rotation.hadamard, error_feedback=True),
        weight_diff=QuantSpec(scheme="mx", bits=4),
        hpz=True,
    ),
}
"""The named recipes (the runner's ``quant=`` options): ``int8``/``int4``/``qwz`` weights only,
``qgz`` gradients only (INT4), ``hpz`` hierarchical partitioning only, ``w8g8``/``w8g4``/``w4g4``
weights + gradients, ``w4g4h`` = ``w4g4`` with both qgZ hops in a Hadamard-rotated basis
(blocks of 128 = the gradient group size), ``zeropp`` qwZ INT8 + hpZ + qgZ INT4 (the ZeRO++
paper's setting), ``qwd`` INT4 weight differences refreshing hpZ's secondaries, gathers unquantized (stage 3,
which needs hpZ for them; for stages 1-2 add ``zero.hpz=false``), ``sdp4bit`` SDP4Bit's setting at stage 3: INT4 weight differences refreshing
hpZ's secondary copies (the first gather INT4 qwZ), Hadamard-rotated INT4 gradients with error
feedback.

The float and microscaling recipes quantize weights and gradients alike: ``fp8`` FP8 with an fp32
scale per group, E4M3 weights and E5M2 gradients (the usual split: precision forward, range
backward); ``mxfp8`` MXFP8 (E4M3) with the ``round_up`` scale rule of MXFP8 training recipes;
``mxfp6`` MXFP6, E2M3 weights and E3M2 gradients; ``mxfp4`` MXFP4 (E2M1, OCP scale rule); ``mxint8`` MXINT8;
``nvfp4`` NVFP4; ``w_mxfp8_g_mxfp4`` MXFP8 weights and gradients sent MXFP8 inside the node and
MXFP4 across; ``sdp4bit_mx`` ``sdp4bit`` with MXFP4 in place of INT4 (rotation blocks of 32,
the MX block).

``w4g4h`` rotates the gradients only, where SDP4Bit applies the rotation: gradients are
heavy-tailed, so spreading their outliers lowers the INT4 error, while weights are close to
Gaussian (nothing to spread) and a flat stage-3 shard puts parameters of very different scales
(LayerNorm gains of 1, weights of 0.02) in one block, where rotation mixes the large into the
small. Measured on the 2x2 tiny-GPT test run: rotating the gradients halved the mean loss gap
to fp of ``w4g4``, rotating the weights as well doubled it. ``zero.weights.rotation=hadamard``
rotates the weight gathers too."""
