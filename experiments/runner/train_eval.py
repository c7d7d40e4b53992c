"""The training loop's evaluation: the held-out loss every ``train.eval_every`` steps and at the end.

Each ``Trainer.eval_loss`` call is collective (the mean over ranks), so every rank evaluates at the
same steps: the schedule depends only on the config and the step.
"""

from __future__ import annotations

from .config import TrainConfig
from .data import TokenBatches
from .train_data import TrainData
from .trainers import Trainer


def evaluate(trainer: Trainer, batches: TokenBatches, rounds: int, rank: int, world: int) -> float:
    """Mean held-out loss over ``rounds`` rounds; in round k data-parallel rank r evaluates held-out
    batch ``k * world + r``, so the ranks of a round read distinct batches."""
    return sum(trainer.eval_loss(*batches.eval_batch(k * world + rank)) for k in range(rounds)) / rounds


class Evaluator:
    """When to evaluate during training, and the evaluation itself."""

    def __init__(self, trainer: Trainer, data: TrainData, train: TrainConfig) -> None:
        self.trainer, self.data = trainer, data
        self.every, self.rounds, self.steps = train.eval_every, train.eval_batches, train.steps

    def due(self, step: int) -> bool:
        """Whether ``step`` evaluates during training (the last step does not: the final
        evaluation follows it)."""
        return bool(self.every) and step % self.every == 0 and step < self.steps

    def run(self) -> float:
        """Collective: the mean held-out loss over ``train.eval_batches`` rounds."""
        return evaluate(self.trainer, self.data.batches, self.rounds, self.data.dp_rank, self.data.dp_world)
