"""Stop a training run that has diverged, at the step it happens, with one clear error.

A non-finite loss or gradient norm means the weights (or the next ones) are garbage: carrying on
only burns time and, worse, lets a checkpoint of that state overwrite the good ones. What counts
as divergence depends on the precision:

* fp32 / bf16 (no loss scaling): the first step whose loss or gradient norm is not finite.
  ``ZeroEngine`` already skips the update of such a step, so the weights in memory are still
  those of the step before.
* fp16 with dynamic loss scaling: a skipped step (overflow) is the scaler's normal way to find its
  scale, so only ``max_skipped_steps`` *consecutive* skipped steps count, i.e. the scale has been
  halved that many times without ever giving a finite gradient. A non-finite loss on a step that
  was *not* skipped stops the run at once (the forward itself is broken).

:class:`DivergenceGuard` holds this rule and the fp16 streak; call :meth:`DivergenceGuard.check`
once per optimizer step with values that are identical on every rank (``ZeroEngine``'s
``StepResult`` loss and norm are global) and it raises :class:`DivergenceError` on all of them at
the same step, so no rank walks into the next collective alone. Any training loop can use it;
the experiment runner's worker does, before its checkpoint save. Written by hand (rather than
with ``torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True)`` or ``GradScaler``) because
neither knows the fp16 streak rule nor ZeroEngine's already-reduced norm.
"""

from __future__ import annotations

import math
from typing import Any

EXIT_CODE = 3
"""Process exit status of a run stopped by :class:`DivergenceError` (2 is a config error, 1 a crash)."""

DEFAULT_ADVICE = (
    "lower the learning rate (optim.lr), enable gradient clipping (zero.grad_clip, e.g. 1.0), "
    "or check the data for bad values"
)
"""What to change, when the caller gives no advice of its own (the library's config field names)."""

FP16_ADVICE = "lower zero.loss_scale_init, lower optim.lr, or train in bf16 (zero.precision=bf16)"
"""What to change after a streak of fp16 overflows, when the caller gives no advice of its own."""


def _num(x: float | None) -> float | str | None:
    """JSON-safe number: finite floats as they are, ``nan`` / ``inf`` / ``-inf`` as strings."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


class DivergenceError(RuntimeError):
    """Training diverged at ``step``; raised by :meth:`DivergenceGuard.check` on every rank.

    ``reason`` is ``"non_finite"`` (a non-finite loss or gradient norm) or ``"skipped_streak"``
    (fp16: ``skipped_streak`` consecutive steps skipped for overflow). :data:`EXIT_CODE` is the
    status a process stopped by it should exit with."""

    exit_code = EXIT_CODE

    def __init__(
        self,
        message: str,
        *,
        step: int,
        loss: float,
        grad_norm: float | None,
        reason: str,
        skipped_streak: int = 0,
        loss_scale: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        self.reason, self.skipped_streak, self.loss_scale = reason, skipped_streak, loss_scale

    def record(self) -> dict[str, Any]:
        """The facts as a JSON-safe dict (non-finite numbers as the strings ``"nan"`` / ``"inf"``),
        e.g. for a run summary; :meth:`from_record` rebuilds the error from it."""
        return {
            "step": self.step,
            "reason": self.reason,
            "loss": _num(self.loss),
            "grad_norm": _num(self.grad_norm),
            "skipped_streak": self.skipped_streak,
            "loss_scale": _num(self.loss_scale),
            "message": self.message,
        }

    def with_note(self, note: str) -> DivergenceError:
        """The same error with ``note`` appended to its message (e.g. where the last good checkpoint is)."""
        return DivergenceError(
            f"{self.message} {note}",
            step=self.step,
            loss=self.loss,
            grad_norm=self.grad_norm,
            reason=self.reason,
            skipped_streak=self.skipped_streak,
            loss_scale=self.loss_scale,
        )

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> DivergenceError:
        """The error :meth:`record` described (e.g. read back from a summary by the launching process)."""

        def f(x: Any) -> float | None:
            return None if x is None else float(x)

        return cls(
            str(rec["message"]),
            step=int(rec["step"]),
            loss=float(rec["loss"]),
            grad_norm=f(rec.get("grad_norm")),
            reason=str(rec["reason"]),
            skipped_streak=int(rec.get("skipped_streak") or 0),
            loss_scale=f(rec.get("loss_scale")),
        )


class DivergenceGuard:
    """Per-run divergence rule (module docstring); one instance per run, fed every step in order.

    ``loss_scaling``: True for fp16 with a dynamic loss scaler (skipped steps are tolerated up to
    ``max_skipped_steps`` in a row), False for fp32/bf16 (any non-finite step stops).
    ``advice``: the "what to change" sentence of the error (default :data:`DEFAULT_ADVICE` /
    :data:`FP16_ADVICE`); ``max_skipped_name`` the name of the limit's setting in messages.
    The streak is not saved with checkpoints: a resumed run starts counting again."""

    def __init__(
        self,
        *,
        loss_scaling: bool,
        max_skipped_steps: int = 50,
        advice: str | None = None,
        max_skipped_name: str = "max_skipped_steps",
    ) -> None:
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"DivergenceGuard needs max_skipped_steps >= 1, got {max_skipped_steps!r}")
        self.loss_scaling, self.max_skipped_steps = loss_scaling, max_skipped_steps
        self.advice = advice or (FP16_ADVICE if loss_scaling else DEFAULT_ADVICE)
        self.max_skipped_name = max_skipped_name
        self.streak = 0
        """Consecutive skipped steps up to the last one checked."""
        self.skipped_steps = 0
        """Steps checked that made no update."""
        self.checked = 0
        """Steps checked."""

    def check(
        self, step: int, loss: float, grad_norm: float | None, skipped: bool, loss_scale: float | None = None
    ) -> str | None:
        """Record optimizer step ``step``; raise :class:`DivergenceError` if the run has diverged.

        ``loss``: the step's global mean loss; ``grad_norm``: its global gradient norm before
        clipping (None if the trainer has none); ``skipped``: no update was made (non-finite
        gradient); ``loss_scale``: the fp16 scale the step used, for the message. Returns a
        one-line warning when an fp16 skip streak reaches half the limit (once per streak), else
        None."""
        self.checked += 1
        self.skipped_steps += int(skipped)
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if not self.loss_scaling or not skipped:
            self.streak = 0
            if finite and not skipped:
                return None
            why = (
                "the loss is not finite"
                if not math.isfinite(loss)
                else "the gradient norm is not finite"
                if not finite
                else "the step was skipped"
            )
            raise DivergenceError(
                f"training diverged at step {step}: loss={_fmt(loss)}, gradient norm={_fmt(grad_norm)} ({why}). "
                f"To fix: {self.advice}.",
                step=step,
                loss=loss,
                grad_norm=grad_norm,
                reason="non_finite",
                loss_scale=loss_scale,
            )
        self.streak += 1
        if self.streak >= self.max_skipped_steps:
            raise DivergenceError(
                f"training diverged at step {step}: {self.streak} consecutive steps skipped for fp16 overflow "
                f"({self.max_skipped_name}={self.max_skipped_steps}), last loss={_fmt(loss)}, gradient "
                f"norm={_fmt(grad_norm)}, loss scale={_fmt(loss_scale)}. To fix: {self.advice}; or allow a longer "
                f"streak with {self.max_skipped_name}.",
                step=step,
                loss=loss,
                grad_norm=grad_norm,
                reason="skipped_streak",
                skipped_streak=self.streak,
                loss_scale=loss_scale,
            )
        if self.max_skipped_steps >= 4 and self.streak == self.max_skipped_steps // 2:
            return (
                f"{self.streak} consecutive steps skipped for fp16 overflow up to step {step} (loss scale "
                f"{_fmt(loss_scale)}); the run stops as diverged at {self.max_skipped_steps} in a row "
                f"({self.max_skipped_name})"
            )
        return None

    def final_warning(self) -> str | None:
        """At the end of a run that did not diverge: a warning if no step of it made an update
        (every step checked was skipped), else None."""
        if self.checked and self.streak == self.checked:
            return (
                f"all {self.checked} steps of this run were skipped for fp16 overflow: the model did not train; "
                f"{self.advice}"
            )
        return None
