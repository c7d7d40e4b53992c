"""Triton quantize / dequantize of the float wire formats (``fp8``, ``mx``, ``nvfp4``).

The public functions have the names and signatures of ``format_reference.py``'s minus ``_ref``
(``format_ops.py`` dispatches CUDA tensors here) and return the same bits: same code bytes, same
scale bits, same output bits, checked under ``TRITON_INTERPRET=1`` by the tests and compiled for
sm_90 by ``compile_check``. The kernels are ``_triton_format_kernels.py``; this module works out
each launch once per (shape, dtype, format, rounding) in a cached plan, as ``quantize.py`` does.

nvfp4 needs each row's absmax before any block can be scaled, so it takes two launches: per tile
the absmax of its finite values, reduced per row by ``torch.amax`` (a max is exact in any order),
then the quantize kernel, which derives the row scale from it.
"""

from __future__ import annotations

import functools
import struct

import torch

from ._triton import LaunchPlan, TileConfig, check_launchable
from ._triton_format_kernels import (
    _fp8_dequantize_kernel,
    _fp8_quantize_kernel,
    _mx_dequantize_kernel,
    _mx_quantize_kernel,
    _nvfp4_dequantize_kernel,
    _nvfp4_quantize_kernel,
    _row_absmax_kernel,
)
from .format_layout import (
    ELEMENTS,
    FIXED_GROUP_SIZE,
    ElementFormat,
    FormatTensor,
    check_format_args,
    check_format_tensor,
    check_scale_rule,
    code_bytes,
    num_groups,
)
from .layout import output_rows, row_stride

PLAN_CACHE_SIZE = 1024
"""Launch plans kept per launcher (one per distinct shape / dtype / format / rounding in use)."""


def max_code(f: ElementFormat) -> int:
    """Magnitude code of the largest finite value: ``(e - emin) * 2**mbits + max / 2**(e - mbits)``
    with ``e = floor(log2 max)`` (0x7E for E4M3, 0x7B for E5M2, 31 for E3M2 / E2M3, 7 for E2M1)."""
    e = int(f.max).bit_length() - 1
    return (e - f.emin) * (1 << f.mbits) + int(f.max / 2.0 ** (e - f.mbits))


def element_consts(f: ElementFormat) -> dict:
    """The kernels' constexprs for element format ``f``."""
    return dict(
        INT8=f.is_int,
        E=f.ebits,
        M=f.mbits,
        BIAS=f.bias,
        MAX_MAG=0 if f.is_int else max_code(f),
        MAX_VAL=f.max,
        NAN_MAG=-1 if f.nan_code is None else f.nan_code,
    )


def decode_consts(f: ElementFormat) -> dict:
    """The dequantize kernels' constexprs for element format ``f`` (E5M2 has IEEE Inf / NaN codes)."""
    c = element_consts(f)
    return dict(INT8=c["INT8"], E=c["E"], M=c["M"], BIAS=c["BIAS"], NAN_MAG=c["NAN_MAG"], IEEE=f.name == "e5m2")


def mantissa_bits(value: float) -> int:
    """The 23 fraction bits of ``value`` as fp32."""
    return struct.unpack("<I", struct.pack("<f", value))[0] & 0x7FFFFF


# ----------------------------------------------------------------------------------------------
# Plans.
# ----------------------------------------------------------------------------------------------
class Plan:
    """Layout and launch(es) of one quantize or dequantize: the rows, columns, blocks, and the
    bound launches (None for an empty tensor: nothing to launch)."""

    def __init__(self, rows: int, cols: int, elem: str, group_size: int) -> None:
        self.rows, self.cols, self.elem, self.group_size = rows, cols, elem, group_size
        self.groups = num_groups(cols, group_size)
        self.code_bytes = code_bytes(cols, elem, group_size)
        self.cfg = TileConfig(group_size, self.groups, rows) if rows * self.groups else None
        self.launch: LaunchPlan | None = None
        """The quantize / dequantize kernel's launch."""
        self.absmax: LaunchPlan | None = None
        """nvfp4's quantize: the per-tile absmax launch that comes first."""


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def quantize_plan(scheme: str, rows: int, cols: int, elem: str, group_size: int, rule: str, stochastic: bool) -> Plan:
    p = Plan(rows, cols, elem, group_size)
    cfg = p.cfg
    if cfg is None:
        return p
    f = ELEMENTS[elem]
    fixed = (cols, p.groups, cols, p.code_bytes)
    if scheme == "fp8":
        consts = element_consts(f)
        del consts["INT8"]
        consts.update(GROUP_SIZE=group_size, STOCHASTIC=stochastic)
        p.launch = LaunchPlan(_fp8_quantize_kernel, cfg, (*fixed, p.groups, cfg.tiles_per_row), consts)
    elif scheme == "mx":
        consts = dict(element_consts(f), GROUP_SIZE=group_size, BITS=f.bits, EMAX=f.emax)
        consts.update(MAX_MANT=mantissa_bits(f.max), ROUND_UP=rule == "round_up", STOCHASTIC=stochastic)
        p.launch = LaunchPlan(_mx_quantize_kernel, cfg, (*fixed, p.groups, cfg.tiles_per_row), consts)
    else:
        p.absmax = LaunchPlan(_row_absmax_kernel, cfg, (cols, p.groups, cols, cfg.tiles_per_row), {"GROUP_SIZE": 16})
        p.launch = LaunchPlan(
            _nvfp4_quantize_kernel,
            cfg,
            (*fixed, p.groups, 1, cfg.tiles_per_row),
            {"GROUP_SIZE": 16, "STOCHASTIC": stochastic},
        )
    return p


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def dequantize_plan(scheme: str, rows: int, cols: int, elem: str, group_size: int, strides: tuple[int, ...]) -> Plan:
    """``strides``: the codes', scales', (nvfp4) tensor scales' and output's row strides."""
    p = Plan(rows, cols, elem, group_size)
    if p.cfg is None:
        return p
    f = ELEMENTS[elem]
    ints = (cols, p.groups, *strides, p.cfg.tiles_per_row)
    if scheme == "fp8":
        consts = decode_consts(f)
        del consts["INT8"]
        p.launch = LaunchPlan(_fp8_dequantize_kernel, p.cfg, ints, dict(consts, GROUP_SIZE=group_size))
    elif scheme == "mx":
        p.launch = LaunchPlan(
            _mx_dequantize_kernel, p.cfg, ints, dict(decode_consts(f), GROUP_SIZE=group_size, BITS=f.bits)
        )
    else:
        p.launch = LaunchPlan(_nvfp4_dequantize_kernel, p.cfg, ints, {"GROUP_SIZE": 16})
    return p


# ----------------------------------------------------------------------------------------------
# Launchers.
# ----------------------------------------------------------------------------------------------
def _quantize(
    x: torch.Tensor, scheme: str, elem: str, group_size: int, rule: str, rows: int, stochastic: bool, seed: int
) -> FormatTensor:
    cols, seed = check_format_args(x, scheme, elem, group_size, rows, seed)
    if not x.is_cuda:
        check_launchable(x)
    plan = quantize_plan(scheme, rows, cols, elem, group_size, rule, bool(stochastic))
    x = x.reshape(rows, cols).contiguous()
    dev = x.device
    codes = torch.empty(rows, plan.code_bytes, dtype=torch.uint8, device=dev)
    sdt = torch.float32 if scheme == "fp8" else torch.uint8
    scales = torch.empty(rows, plan.groups, dtype=sdt, device=dev)
    tensor = torch.zeros(rows, 1, dtype=torch.float32, device=dev) if scheme == "nvfp4" else None
    scalars = (seed if stochastic else 0,)
    if plan.launch is not None and tensor is not None and plan.absmax is not None and plan.cfg is not None:
        parts = torch.empty(rows, plan.cfg.tiles_per_row, dtype=torch.float32, device=dev)
        plan.absmax((x, parts))
        row_absmax = parts.amax(dim=1)
        plan.launch((x, row_absmax, codes, scales, tensor), scalars)
    elif plan.launch is not None:
        plan.launch((x, codes, scales), scalars)
    return FormatTensor(codes, scales, tensor, cols, scheme, elem, group_size)


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` and its row stride (a contiguous copy when its rows are not a fixed stride apart)."""
    s = row_stride(t)
    if s is None:
        t = t.contiguous()
        s = t.shape[-1]
    return t, s


def _dequantize(q: FormatTensor, scheme: str, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    rows = check_format_tensor(q, scheme)
    if not q.codes.is_cuda:
        check_launchable(q.codes)
    out, os_ = output_rows(out, rows, q.cols, dtype, q.codes.device)
    codes, cs = _rows_of(q.codes)
    scales, ss = _rows_of(q.scales)
    tensors: tuple[torch.Tensor, ...] = (codes, scales)
    strides: tuple[int, ...] = (cs, ss)
    if q.tensor_scales is not None:  # nvfp4
        tensor, ts = _rows_of(q.tensor_scales)
        tensors, strides = (codes, scales, tensor), (cs, ss, ts)
    plan = dequantize_plan(scheme, rows, q.cols, q.elem, q.group_size, (*strides, os_))
    if plan.launch is not None:
        plan.launch((*tensors, out))
    return out


# ----------------------------------------------------------------------------------------------
# Public functions (``format_reference``'s signatures).
# ----------------------------------------------------------------------------------------------
def quantize_fp8(
    x: torch.Tensor, elem: str, group_size: int, *, rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """E4M3 / E5M2 elements, one fp32 scale ``absmax / max`` per ``group_size`` elements."""
    return _quantize(x, "fp8", elem, group_size, "ocp", rows, stochastic, seed)


def quantize_mx(
    x: torch.Tensor, elem: str, *, scale_rule: str = "ocp", rows: int = 1, stochastic: bool = False, seed: int = 0
) -> FormatTensor:
    """MX: ``elem`` elements in blocks of 32, one E8M0 shared exponent per block."""
    check_scale_rule(scale_rule)
    return _quantize(x, "mx", elem, FIXED_GROUP_SIZE["mx"], scale_rule, rows, stochastic, seed)


def quantize_nvfp4(x: torch.Tensor, *, rows: int = 1, stochastic: bool = False, seed: int = 0) -> FormatTensor:
    """NVFP4: E2M1 elements, an E4M3 scale per 16 and an fp32 scale per row."""
    return _quantize(x, "nvfp4", "e2m1", FIXED_GROUP_SIZE["nvfp4"], "ocp", rows, stochastic, seed)


def dequantize_fp8(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * scale``."""
    return _dequantize(q, "fp8", out, dtype)


def dequantize_mx(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """mx FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * 2**(e8m0 - 127)``."""
    return _dequantize(q, "mx", out, dtype)


def dequantize_nvfp4(
    q: FormatTensor, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """nvfp4 FormatTensor ``[rows, *]`` -> ``[rows, cols]``: ``code_value * (decode(b) * t)``."""
    return _dequantize(q, "nvfp4", out, dtype)
