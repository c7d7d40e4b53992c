"""Exactness: in fp32 without quantization, ZeRO stages 0-3 train exactly like one process.

Each world trains several engines in turn on the same per-rank data and compares, for 10 steps
with gradient accumulation (2 micro-batches) and clipping (which engages: the gradient norm is
above the threshold), the losses, the gradient norms and the final weights with single-process
training on the global batch (``torch.optim.AdamW`` + ``clip_grad_norm_``).

Weights are compared by norm-relative error over the whole model (1e-5). Per tensor the bound
is looser (2e-4) for one reason: the key part of the attention's qkv bias has an exactly zero
true gradient (softmax ignores a constant added to every key), so its gradient is pure rounding
noise, and Adam's normalised step turns noise of any size into moves of about ``lr``.

The 2x2 world trains the GPT as built by default (tied embeddings); the 3x2 world the GPT with its
own head weight: with the tied model's initial weights the key bias noise above reaches 2.4e-4 on
6 ranks at stage 0 (every other tensor stays within 3e-6). Tied weights on every stage are also
covered by ``test_runtime_tied``.
"""

import numpy as np

from tests.parity_helpers import BASE, STAGES, STEPS, check_parity
from tests.runtime_helpers import TINY, parity_world
from tests.worlds import run_world

# Other code paths that must be just as exact: chunked buckets, no / deeper prefetch,
# replicated small parameters, hpZ (unquantized it only changes where the bytes come from), blocks
# coalesced into one unit (stage 2's reduce-scatter, stage 3's gathers and reduce-scatter); KEPT: two
# of them again with the root and the last block kept gathered from forward into backward
# (keep_at_turn), which must change no bit of the result (the same gathered values, the same sums).
VARIANTS = [
    dict(BASE, stage=3, prefetch_depth=0, reduce_bucket_size=1000, allgather_bucket_size=1500),
    dict(BASE, stage=3, prefetch_depth=2, persistence_threshold=100, hpz=True),
    dict(BASE, stage=2, reduce_bucket_size=777, coalesce_numel=10**9),
    dict(BASE, stage=3, coalesce_numel=10**9, hpz=True),
    dict(BASE, stage=1, allgather_bucket_size=999),
]
KEPT = [dict(VARIANTS[1], keep_at_turn=True), dict(VARIANTS[3], keep_at_turn=True)]


def test_stages_match_single_process_2x2():
    configs = STAGES + VARIANTS + KEPT
    results = run_world(parity_world, 4, 2, configs, STEPS, timeout=240)
    check_parity(results, 4, configs)
    for kept in KEPT:
        twin = results[0][configs.index({k: v for k, v in kept.items() if k != "keep_at_turn"})]
        mine = results[0][configs.index(kept)]
        assert mine["losses"] == twin["losses"] and mine["norms"] == twin["norms"], kept
        assert all(np.array_equal(mine["weights"][k], twin["weights"][k]) for k in twin["weights"]), kept


def test_stages_match_single_process_3x2():
    untied = TINY.with_(tie_embeddings=False)  # see the module docstring
    check_parity(run_world(parity_world, 6, 3, STAGES, STEPS, "cpu", untied, timeout=240), 6, STAGES, cfg=untied)
