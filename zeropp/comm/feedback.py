"""Error-feedback state of the quantized reduce-scatter: an object the caller owns.

``QuantSpec.error_feedback`` says whether residuals are kept; an :class:`ErrorFeedback` holds
them, one per model (or per FSDP module / DDP state), keyed by gradient bucket. The state stays
outside the spec so that the spec remains a value (hashable, shareable across models and logs).
"""

from __future__ import annotations

from typing import Optional

import torch


class ErrorFeedback:
    """Error feedback (the LoCo / EF-SGD idea) for the quantized reduce-scatter.

    Each rank keeps, per bucket ``key``, the residual of *its own* first-hop quantization,
    ``r = x - dequantize(quantize(x))`` with ``x = gradient + previous r``, in fp32, and adds it to
    the next gradient of that bucket before quantizing. What one step rounds away is sent in a
    later step, so the quantization error does not accumulate in the weights. Only the first hop
    is compensated (the later re-quantization of partial sums is shared by several ranks). A
    non-finite block leaves a zero residual, so a skipped overflow step does not poison later ones.
    Residuals are laid out like the input and cost 4 bytes per gradient element.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of bucket ``key`` ([numel]); zeros the first time."""
        r = self._residuals.get(key)
        if r is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        if r.numel() != numel:
            raise ValueError(
                f"error-feedback bucket {key!r} holds {r.numel()} elements but this call has {numel}; "
                f"use one feedback_key per gradient bucket (or reset({key!r}))"
            )
        return r

    def store(self, key: str, residual: torch.Tensor) -> None:
        self._residuals[key] = torch.nan_to_num(residual.reshape(-1).float(), nan=0.0, posinf=0.0, neginf=0.0)

    def reset(self, key: Optional[str] = None) -> None:
        """Forget one bucket's residual, or all (e.g. after loading a checkpoint)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._residuals)

    def nbytes(self) -> int:
        return sum(r.numel() * 4 for r in self._residuals.values())
