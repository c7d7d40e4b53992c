"""The toy codec of the codec-registry tests: the ``int`` codec applied to ``x + OFFSET`` (and
``OFFSET`` subtracted after dequantizing), a stand-in for schemes that transform values before
the integer quantizer. It implements only the required ``Codec`` methods, so reductions run
through the generic ``Codec`` code."""

from __future__ import annotations

import torch

from zeropp.comm.codecs import Codec, IntCodec

OFFSET = 1.0
"""What the toy adds before quantizing and subtracts after."""


class OffsetCodec(Codec):
    """int codec of ``x + OFFSET``; only the required methods (generic reductions)."""

    def __init__(self) -> None:
        self.int = IntCodec()

    def quantize(self, x, bits, group_size, *, rows, seed):
        return self.int.quantize(x.float() + OFFSET, bits, group_size, rows=rows, seed=seed)

    def dequantize(self, q, *, out=None, dtype=torch.float32):
        v = self.int.dequantize(q) - OFFSET  # [rows, cols] fp32
        if out is None:
            return v.to(dtype)
        out.view(-1).copy_(v.view(-1))
        return out

    def wire_bytes(self, cols, bits, group_size):
        return self.int.wire_bytes(cols, bits, group_size)

    def pack(self, q):
        return self.int.pack(q)

    def unpack(self, buf, cols, bits, group_size):
        return self.int.unpack(buf, cols, bits, group_size)
