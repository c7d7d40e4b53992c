"""Rank-dependent unused parameters.

Stages 2 and 3 send the gradient reduce-scatters in one fixed order on every rank (zeros for
parameters a rank did not use), so when rank 1 skips the MLP half of block 1 (its parameters get no
gradient there) training matches a single-process reference on the same global batch. When rank 1
skips block 1 entirely, stage 2 still matches; stage 3 (whose gathers follow the blocks that run)
detects it after forward and raises a clear error on every rank, without hanging."""

import torch
import torch.distributed as dist

from tests.runtime_helpers import TINY, micro_batch, rank_batches, rel_err
from tests.worlds import run_world
from zeropp.models import GPT
from zeropp.models.gpt import Block

SKIP_BLOCK, SKIP_RANK = 1, 1
LR, STEPS, ACCUM = 1e-2, 2, 2
# (what rank 1 skips, stage, prefetch_depth); without prefetch, stage 3's backward gathers and
# reduce-scatters interleave, so a reduce-scatter issued late on one rank would pair with a gather
CASES = [("block", 2, 1), ("mlp", 2, 1), ("mlp", 3, 0), ("mlp", 3, 1)]


class MaybeMlpBlock(Block):
    """A block that runs only its attention half when ``skip_mlp`` is set (inside its own forward,
    so stage 3's hooks gather its parameters as usual)."""

    skip_mlp = False

    def forward(self, x):
        if not self.skip_mlp:
            return super().forward(x)
        return x + self.attn(self.ln1(x))


class SkipGPT(GPT):
    """GPT whose forward skips block ``SKIP_BLOCK`` (``mode="block"``) or only its MLP half
    (``mode="mlp"``) when ``skip`` is true (default: on rank ``SKIP_RANK``)."""

    def __init__(self, cfg, mode):
        super().__init__(cfg)
        self.mode = mode
        self.blocks[SKIP_BLOCK].__class__ = MaybeMlpBlock

    def forward(self, idx, targets=None, skip=None):
        if skip is None:
            skip = dist.is_initialized() and dist.get_rank() == SKIP_RANK
        _b, t = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t))
        for i, block in enumerate(self.blocks):
            if i == SKIP_BLOCK:
                block.skip_mlp = bool(skip) and self.mode == "mlp"
            if not (skip and i == SKIP_BLOCK and self.mode == "block"):
                x = block(x)
        logits = self.head(self.ln_f(x))
        loss = (
            None
            if targets is None
            else torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        )
        return logits, loss


def _model(mode):
    torch.manual_seed(0)
    return SkipGPT(TINY, mode)


def _reference(world, mode):
    """Single process: per micro index, the mean of each rank's loss (rank SKIP_RANK skipping the block)."""
    model = _model(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        tot = 0.0
        for j in range(ACCUM):
            ls = [model(*micro_batch(s, j, r), skip=r == SKIP_RANK)[1] for r in range(world)]
            loss = sum(ls) / world
            (loss / ACCUM).backward()
            tot += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(tot / ACCUM)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unused_world(rank, world):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    def engine(mode, **kw):
        return ZeroEngine(
            _model(mode),
            config=ZeroConfig(grad_accum_steps=ACCUM, grad_clip=1.0, **kw),
            optimizer=OptimizerConfig(lr=LR, weight_decay=0.01),
            topology=Topology.single_node(world),
        )

    out = {}
    for mode, stage, depth in CASES:
        eng = engine(mode, stage=stage, prefetch_depth=depth)
        res = [eng.train_step(rank_batches(s, ACCUM, rank)) for s in range(STEPS)]
        out[mode, stage, depth] = {
            "losses": [r.loss for r in res],
            "norms": [r.grad_norm for r in res],
            "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
        }
        eng.close()

    out["stage3"] = []
    for depth in (0, 1):
        eng = engine("block", stage=3, prefetch_depth=depth)
        try:
            eng.train_step(rank_batches(0, ACCUM, rank))
            out["stage3"].append(None)
        except RuntimeError as e:
            out["stage3"].append(str(e))
        eng.close()
    dist.barrier()  # the world is still usable after the error
    return out


def test_rank_dependent_unused_block(tmp_path):
    world = 2
    res = run_world(_unused_world, world, timeout=90)
    refs = {mode: _reference(world, mode) for mode in ("block", "mlp")}
    for rank, r in enumerate(res):
        for mode, stage, depth in CASES:
            got, (losses, norms, weights) = r[mode, stage, depth], refs[mode]
            assert max(abs(a - b) / b for a, b in zip(got["losses"], losses)) < 1e-5, (
                mode,
                stage,
                got["losses"],
                losses,
            )
            assert max(abs(a - b) / b for a, b in zip(got["norms"], norms)) < 1e-4, (mode, stage, got["norms"], norms)
            for k, v in weights.items():  # tolerance as test_runtime_parity
                assert rel_err(torch.from_numpy(got["weights"][k]), v) <= 2e-4, (mode, stage, k)
        for msg in r["stage3"]:
            assert msg is not None, f"rank {rank}: stage 3 did not detect the skipped block"
            assert "block1 ran on ranks [0] but not on [1]" in msg and "every block on every rank" in msg, msg
