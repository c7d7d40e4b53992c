"""Loss scaling as a small object the engine asks, instead of two loose engine fields.

fp16 gradients underflow without scaling and overflow with too much of it, so fp16 training
multiplies the loss by a *dynamic* scale: halved (and the step skipped) whenever the gradient is
not finite, doubled after ``window`` finite steps in a row. fp32 and bf16 have the range of fp32
and need none: they get :class:`StaticLossScaler` (scale 1.0, never changes), so the engine's code
path is the same for every precision. Both save and restore their state through
``state_dict`` / ``load_state_dict`` (plain numbers: the checkpoint stores them as metadata).
"""

from __future__ import annotations

from typing import Protocol


class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward (gradients are divided by it)."""
        ...

    def update(self, finite: bool) -> None:
        """Record whether this step's (unscaled) gradient was finite; adjusts the scale."""
        ...

    def state_dict(self) -> dict[str, float | int]: ...

    def load_state_dict(self, state: dict[str, float | int]) -> None: ...


class StaticLossScaler:
    """Scale 1.0 forever (fp32, bf16)."""

    scale = 1.0

    def update(self, finite: bool) -> None:
        pass

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": 1.0, "good_steps": 0}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        pass  # a dynamic scaler's state is meaningless here: fp32/bf16 never scale


class DynamicLossScaler:
    """fp16's scale: halve on overflow, double after ``window`` good steps in a row."""

    def __init__(self, init: float = 2.0**16, window: int = 1000) -> None:
        if not init > 0 or window < 1:
            raise ValueError(f"DynamicLossScaler needs init > 0 and window >= 1, got init={init}, window={window}")
        self.scale = float(init)
        self.window = window
        self.good_steps = 0
        """Finite steps since the scale last changed."""

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.good_steps = self.scale / 2, 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale, self.good_steps = self.scale * 2, 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def make_loss_scaler(precision: str, init: float, window: int) -> DynamicLossScaler | StaticLossScaler:
    """Dynamic for ``fp16``, static otherwise."""
    return DynamicLossScaler(init, window) if precision == "fp16" else StaticLossScaler()
