"""The analytic tensor-parallel communication of this repo's GPT block, for tests that check
what CommWatch counts (one block in ``test_experiments_commwatch``, a whole run in
``test_experiments_e2e``)."""

from __future__ import annotations


def tp_block_bytes(batch: int, seq: int, d_model: int, tp: int, itemsize: int = 4) -> dict[str, int]:
    """What one rank sends for forward + backward of one TP block, as this repo splits it
    (``zeropp.models.gpt.parallelize_gpt``, Megatron-style):

    * forward: ``attn.proj`` and ``out`` are row-parallel: each rank's output is a partial sum,
      made whole by an all-reduce of the activations ``[batch, seq, d_model]`` (2 all-reduces);
    * backward: ``attn.qkv`` and ``fc`` are column-parallel on a replicated input: the gradient of
      that input ``[batch, seq, d_model]`` is a partial sum, all-reduced (2 all-reduces);
      row-parallel layers need nothing in backward (their input gradient stays sharded), and the
      replicated biases' gradients are computed after the forward all-reduce, so need none.

    An all-reduce of ``n`` bytes over ``tp`` ranks is counted as ``2 n / tp`` to each of the other
    ``tp - 1`` members (zeropp.comm.stats convention). The tp group lies inside a node: intra.
    """
    n = batch * seq * d_model * itemsize
    one = 2 * n // tp * (tp - 1)
    return {"forward": 2 * one, "backward": 2 * one}
