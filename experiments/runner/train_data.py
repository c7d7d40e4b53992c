"""The training loop's data: this rank's batches and the cursor through them.

The ranks of a tensor-parallel group compute on the same batches, so the data is split over the
data-parallel ranks only (``topology.dp_index`` / ``dp_size``). A step reads
``zero.grad_accum_steps`` micro-batches; a resumed run skips the micro-batches of the steps it
already trained, so it reads what an uninterrupted run would have read.
"""

from __future__ import annotations

import torch

from .config import RunConfig
from .data import TokenBatches


class TrainData:
    """This rank's training and held-out batches (``data.TokenBatches``) and its step cursor."""

    def __init__(self, cfg: RunConfig, rank: int, device: torch.device) -> None:
        self.accum = cfg.zero.grad_accum_steps
        """Micro-batches per optimizer step."""
        self.dp_rank, self.dp_world = cfg.topology.dp_index(rank), cfg.topology.dp_size
        """This rank's index among the data-parallel ranks, and their number."""
        self.batches = TokenBatches(
            cfg.data,
            seq_len=cfg.model.seq_len,
            batch=cfg.train.micro_batch_size,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed,
            rank=self.dp_rank,
            device=device,
        )

    def skip_steps(self, steps: int) -> None:
        """Skip the micro-batches of ``steps`` optimizer steps (a resumed run's trained steps)."""
        self.batches.skip(steps * self.accum)

    def step_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches."""
        return [self.batches.next() for _ in range(self.accum)]
