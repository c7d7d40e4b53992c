"""Frozen parameters at every stage, sharded at stage 3, and MixZ++ (``quantize_frozen``).

- parity: a LoRA GPT (base frozen, adapters trained) and a GPT with frozen parts (the position
  embedding and the whole block 1: a block with frozen parameters only) trained by ZeroEngine at
  stages 0-3 (stage 3 also with hpZ and a prefetch depth of 2, and with activation checkpointing) on a 2x2 gloo world in fp32 match
  single-process training on the global batch, to the tolerance of ``test_runtime_parity``;
- stage 3 really shards them: per rank ``ceil(numel / W)`` elements per frozen unit, and the
  frozen gathers' bytes follow the formula (twice per unit per micro-step, ``B * (W - 1)`` each);
- ``quantize_frozen=int8|int4``: the forward equals a reference model whose frozen weights are
  ``dequantize(quantize(shard))`` of each rank's shard, exactly; the per-rank bytes are the wire
  rows'; exports and checkpoints return those dequantized values (exact originals without it);
- MixZ++ with hpZ: INT8 frozen gathers stay inside the node after the first forward, same losses;
- ``offload_param=cpu|nvme`` moves the frozen shards too, with identical losses;
- bad input: ``quantize_frozen`` at stages 0-2 or an unknown value.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_frozen.py``.
"""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------------- bad input
def test_quantize_frozen_is_validated() -> None:
    from zeropp.runtime import ZeroConfig

    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=r"quantize_frozen='int8'.*stage=3"):
            ZeroConfig(stage=stage, quantize_frozen="int8")
    with pytest.raises(ValueError, match=r"quantize_frozen='fp8'.*'none', 'int8', 'int4'"):
        ZeroConfig(stage=3, quantize_frozen="fp8")
    assert ZeroConfig(stage=3, quantize_frozen="int4").quantize_frozen == "int4"
    assert ZeroConfig(stage=1).quantize_frozen == "none"
