"""The ``torch.compile`` baseline of ``python -m experiments.bench_kernels``: the plain torch
formulations of each op, as a user would write them, compiled once per op with the block count
dynamic (as the compiled CPU kernels are).

Not bit-exact with the reference (``round`` is half-to-even; no NaN-block handling), only the
same work; the benchmark compares times, never values.
"""

from __future__ import annotations

from typing import Callable

import torch


def plain_quantize(v: torch.Tensor, bits: int, stochastic: bool = False):
    """v [n, gs] -> (codes [n, gs * bits / 8], scales [n])."""
    q = 2 ** (bits - 1) - 1
    scale = v.float().abs().amax(dim=-1) / q
    t = v.float() / scale.clamp_min(1e-30).unsqueeze(-1)
    t = torch.floor(t + torch.rand_like(t)) if stochastic else torch.round(t)
    codes = t.clamp(-q, q).to(torch.int8)
    if bits == 4:
        nib = (codes + 8).to(torch.uint8)
        codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return codes, scale


def plain_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., n, bpg], scales [..., n] -> [..., n, gs] in ``dtype``."""
    if bits == 4:
        c = torch.stack([(codes & 0xF).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8], dim=-1).flatten(-2)
    else:
        c = codes
    return (c.float() * scales.unsqueeze(-1)).to(dtype)


def plain_dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    return plain_dequantize(codes, scales, bits, torch.float32).sum(dim=0).to(dtype)


def plain_reduce(codes: torch.Tensor, scales: torch.Tensor, bits: int):
    return plain_quantize(plain_dequantize(codes, scales, bits, torch.float32).sum(dim=0), bits)


class Compiled:
    """``torch.compile`` of the plain formulations, one compiled function per op (block count dynamic)."""

    def __init__(self) -> None:
        self.fns: dict[str, Callable] = {}

    def __call__(self, name: str, fn: Callable, *tensors: torch.Tensor, dims: tuple[int, ...], **kw) -> Callable:
        if name not in self.fns:
            self.fns[name] = torch.compile(fn)
        for t, d in zip(tensors, dims):
            torch._dynamo.maybe_mark_dynamic(t, d)
        compiled = self.fns[name]
        return lambda: compiled(*tensors, **kw)
