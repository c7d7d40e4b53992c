"""A user's script of the shape of README's "import the quantized collectives" example, run by
``tests/e2e/test_comm_lifetime.py`` under torchrun: every rank must print its check and the process
must then end with exit status 0, every time (no SIGABRT in the interpreter's teardown).

    torchrun --standalone --nproc-per-node 4 tests/data/readme_collectives.py [RANKS_PER_NODE] [--destroy]

RANKS_PER_NODE defaults to README's 2 (with 4 ranks: 2 nodes of 2, so qgZ is hierarchical and
its second hop runs on the comm worker thread); ``--destroy`` ends with
``dist.destroy_process_group()``.
"""

import sys

import torch
import torch.distributed as dist

from zeropp.comm import (
    CommStats,
    ErrorFeedback,
    QuantSpec,
    Topology,
    quantized_all_gather,
    quantized_reduce_scatter,
    set_topology,
)

dist.init_process_group("gloo")
W, rank = dist.get_world_size(), dist.get_rank()
rpn = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2 if W % 2 == 0 else W
topo = Topology.from_world(W, ranks_per_node=rpn)
topo.build(); set_topology(topo)
stats = CommStats()


def inputs(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return torch.randn(1000, generator=g), torch.randn(1000 * W, generator=g).bfloat16()


shard, grad = inputs(rank)
full = torch.empty(1000 * W)
quantized_all_gather(full, shard, spec=QuantSpec(bits=8), stats=stats)                       # qwZ
mine = torch.empty(1000, dtype=torch.bfloat16)
ef = ErrorFeedback()
handle = quantized_reduce_scatter(mine, grad, spec=QuantSpec(bits=4, intra_bits=8, error_feedback=True),
                                  error_feedback=ef, feedback_key="bucket0", stats=stats, async_op=True)  # qgZ
handle.wait()

everyone = [inputs(r) for r in range(W)]
gathered_err = max((full[r * 1000:(r + 1) * 1000] - s).abs().max().item() for r, (s, _) in enumerate(everyone))
avg = torch.stack([g.float() for _, g in everyone]).mean(0)[rank * 1000:(rank + 1) * 1000]
rel = ((mine.float() - avg).norm() / avg.norm()).item()
assert gathered_err < 0.05 and rel < 0.3, (gathered_err, rel)
print(f"rank {rank} ok: all-gather max error {gathered_err:.4f}, reduce-scatter relative error {rel:.3f}, "
      f"bytes {stats.snapshot()}", flush=True)
if "--destroy" in sys.argv:
    dist.destroy_process_group()
