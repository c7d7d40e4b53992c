"""Triton launchers of the float formats' reductions over received wire rows (the kernels are
``_triton_format_reduce_kernels.py``): the CUDA counterparts of ``cpu_format_wire.dequantize_sum_wire``
and ``cpu_format_wire.dequantize_sum_requantize_wire``, with their signatures and their bits (the
codecs' generic path: each source dequantized, added in fp32 in source order from zero, then
rounded or quantized), checked under ``TRITON_INTERPRET=1`` by the tests and compiled for sm_90 by
``compile_check``. ``FormatCodec`` dispatches CUDA wire rows here.

fp8 and mx re-quantize each summed tile in the same program (one pass over the k sources). nvfp4
cannot: its per-row tensor scale needs the whole summed row's absmax first, so its sum goes to an
fp32 scratch row by the sum kernel and is quantized from there (``triton_formats``' two launches).
"""

from __future__ import annotations

import functools

import torch

from . import triton_formats as tf
from ._triton import HAS_TRITON, LaunchPlan, TileConfig, check_launchable
from ._triton_format_reduce_kernels import (
    _format_dequantize_sum_kernel,
    _fp8_sum_requantize_kernel,
    _mx_sum_requantize_kernel,
)
from .format_layout import ELEMENTS, check_requantize_args, code_bytes, num_groups, pack, received_rows, wire_bytes
from .layout import output_rows
from .triton_formats import PLAN_CACHE_SIZE, decode_consts, element_consts, mantissa_bits

__all__ = ["HAS_TRITON", "dequantize_sum_requantize_wire", "dequantize_sum_wire"]

SCHEME_IDS = {"fp8": 0, "mx": 1, "nvfp4": 2}
"""Scheme names -> the kernels' ``SCHEME`` constexpr."""


def _input_consts(elem: str, suffix: str = "") -> dict:
    """The decode constexprs of the received rows' element format (names suffixed for the
    re-quantize kernels, which also take the output format's)."""
    f = ELEMENTS[elem]
    c = dict(decode_consts(f), BITS=f.bits)
    return {f"{k}{suffix}": v for k, v in c.items()}


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def sum_plan(
    scheme: str, k: int, rows: int, cols: int, elem: str, gs: int, strides: tuple[int, int, int, int]
) -> LaunchPlan | None:
    """The sum kernel's launch for ``k`` sources; ``strides``: the sources', rows' (bytes),
    code bytes per row, output row stride. None when there is nothing to launch."""
    groups = -(-cols // gs)
    if rows * groups == 0:
        return None
    cfg = TileConfig(gs, groups, rows)
    consts = dict(_input_consts(elem), SCHEME=SCHEME_IDS[scheme], GROUP_SIZE=gs)
    k_rs, r_rs, cb, out_rs = strides
    return LaunchPlan(
        _format_dequantize_sum_kernel, cfg, (k, cols, groups, k_rs, r_rs, cb, out_rs, cfg.tiles_per_row), consts
    )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def requantize_plan(
    scheme: str,
    k: int,
    rows: int,
    cols: int,
    elem: str,
    out_elem: str,
    gs: int,
    rule: str,
    stochastic: bool,
    strides: tuple[int, int, int, int, int],
) -> LaunchPlan | None:
    """fp8 / mx: the fused sum-and-quantize kernel's launch. ``strides``: the sources', rows'
    (bytes), input code bytes, output codes' and output scales' row strides."""
    groups = -(-cols // gs)
    if rows * groups == 0:
        return None
    cfg = TileConfig(gs, groups, rows)
    f = ELEMENTS[out_elem]
    out = element_consts(f)
    if scheme == "fp8":
        del out["INT8"]
        consts = dict(_input_consts(elem, "_IN"), **out, GROUP_SIZE=gs, STOCHASTIC=stochastic)
        for key in ("BITS_IN", "INT8_IN"):
            del consts[key]
        kernel = _fp8_sum_requantize_kernel
    else:
        consts = dict(_input_consts(elem, "_IN"), **out, GROUP_SIZE=gs, BITS=f.bits, EMAX=f.emax)
        consts.update(MAX_MANT=mantissa_bits(f.max), ROUND_UP=rule == "round_up", STOCHASTIC=stochastic)
        kernel = _mx_sum_requantize_kernel
    return LaunchPlan(kernel, cfg, (k, cols, groups, *strides, cfg.tiles_per_row), consts)


def _checked(buf: torch.Tensor, scheme: str, elem: str, cols: int, gs: int) -> tuple[torch.Tensor, int, int]:
    buf, cb, g = received_rows(buf, scheme, elem, cols, gs)
    if not buf.is_cuda:
        check_launchable(buf)
    return buf, cb, g


def dequantize_sum_wire(
    buf: torch.Tensor,
    scheme: str,
    elem: str,
    cols: int,
    group_size: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``cpu_format_wire.dequantize_sum_wire`` on the GPU: received rows ``uint8 [k, rows, B]`` -> their
    sum ``[rows, cols]`` in ``dtype`` (or into ``out``, whose dtype wins)."""
    buf, cb, _ = _checked(buf, scheme, elem, cols, group_size)
    k, rows = buf.shape[0], buf.shape[1]
    dst, out_rs = output_rows(out, rows, cols, dtype, buf.device)
    plan = sum_plan(scheme, k, rows, cols, elem, group_size, (buf.stride(0), buf.stride(1), cb, out_rs))
    if plan is not None and k > 0:
        plan((buf, dst))
    elif k == 0:
        dst.zero_()
    return dst


def dequantize_sum_requantize_wire(
    buf: torch.Tensor,
    scheme: str,
    elem: str,
    out_elem: str,
    cols: int,
    group_size: int,
    scale_rule: str,
    stochastic: bool,
    seed: int,
) -> torch.Tensor:
    """``cpu_format_wire.dequantize_sum_requantize_wire`` on the GPU: received rows at ``elem`` -> new
    wire rows ``uint8 [rows, wire_bytes]`` of their sum at ``out_elem``."""
    buf, cb, _ = _checked(buf, scheme, elem, cols, group_size)
    seed = check_requantize_args(scheme, out_elem, scale_rule, seed)
    k, rows = buf.shape[0], buf.shape[1]
    if scheme == "nvfp4" or k == 0:  # the tensor scale needs the summed row's absmax first
        s = dequantize_sum_wire(buf, scheme, elem, cols, group_size)
        return pack(_quantize(s, scheme, out_elem, group_size, scale_rule, rows, stochastic, seed))
    ocb, g = code_bytes(cols, out_elem, group_size), num_groups(cols, group_size)
    wire = torch.empty(rows, wire_bytes(scheme, out_elem, cols, group_size), dtype=torch.uint8, device=buf.device)
    # fp8's fp32 scales sit at byte offsets a GPU store may not use: written aside, copied in
    scales = torch.empty(rows, g, dtype=torch.float32, device=buf.device) if scheme == "fp8" else wire[:, ocb:]
    strides = (buf.stride(0), buf.stride(1), cb, wire.stride(0), scales.stride(0))
    plan = requantize_plan(scheme, k, rows, cols, elem, out_elem, group_size, scale_rule, bool(stochastic), strides)
    if plan is not None:
        plan((buf, wire, scales), (seed if stochastic else 0,))
    if scheme == "fp8":
        wire[:, ocb:].copy_(scales.view(torch.uint8))
    return wire


def _quantize(s: torch.Tensor, scheme: str, elem: str, gs: int, rule: str, rows: int, stochastic: bool, seed: int):
    """The Triton quantizer of ``scheme`` on an fp32 sum (nvfp4's second step; any scheme for k = 0)."""
    if scheme == "nvfp4":
        return tf.quantize_nvfp4(s, rows=rows, stochastic=stochastic, seed=seed)
    if scheme == "mx":
        return tf.quantize_mx(s, elem, scale_rule=rule, rows=rows, stochastic=stochastic, seed=seed)
    return tf.quantize_fp8(s, elem, gs, rows=rows, stochastic=stochastic, seed=seed)
