"""Model-state memory: what each rank holds, and what ZeRO's table says it should hold.

``measure_memory`` reads the sizes of the buffers the engine actually keeps between uses
(transient gathered blocks and in-flight gradient buckets are not model state and are not
counted). ``expected_memory`` is background.md section 1's table with the byte widths as
parameters, plus hpZ's secondary copy (Ψ·p / hpz_size):

| stage | params   | grads    | optimizer (fp32 master + m + v) |
|-------|----------|----------|---------------------------------|
| 0     | pΨ       | gΨ       | 12Ψ                             |
| 1     | pΨ       | gΨ       | 12Ψ/N                           |
| 2     | pΨ       | gΨ/N     | 12Ψ/N                           |
| 3     | pΨ/N     | gΨ/N     | 12Ψ/N                           |

With bf16 (p = g = 2) the rows are 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N.
"""

from __future__ import annotations

from typing import Iterable

from .partition import FlatUnit

KEYS = ("params", "grads", "optimizer", "hpz_secondary", "total")


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def measure_memory(units: Iterable[FlatUnit], optimizer_bytes: int) -> dict[str, int]:
    """Bytes held by this rank now in ``units``' buffers plus ``optimizer_bytes`` of optimizer
    state. Call at the end of backward for the step's peak model state (gradients and hpZ copies
    exist then)."""
    params = grads = hpz = 0
    for u in units:
        params += _nbytes(u.param_shard) if u.kind == "sharded" else _nbytes(u.flat)
        if u.grad_shard is not None:
            grads += _nbytes(u.grad_shard)
        else:  # full gradients held by autograd until the final reduction (stages 0/1, replicated units)
            grads += sum(_nbytes(p.grad) for p in u.params)
        hpz += _nbytes(u.secondary)
    opt = optimizer_bytes
    return {"params": params, "grads": grads, "optimizer": opt, "hpz_secondary": hpz,
            "total": params + grads + opt + hpz}


def expected_memory(stage: int, num_params: int, world_size: int, *, param_bytes: int = 2, grad_bytes: int | None = None,
                    hpz_size: int | None = None) -> dict[str, float]:
    """The table above for ``num_params`` (Ψ) parameters on ``world_size`` (N) ranks."""
    g = param_bytes if grad_bytes is None else grad_bytes
    n, psi = world_size, num_params
    params = psi * param_bytes / (n if stage == 3 else 1)
    grads = psi * g / (n if stage >= 2 else 1)
    opt = 12 * psi / (n if stage >= 1 else 1)
    hpz = psi * param_bytes / hpz_size if hpz_size else 0.0
    return {"params": params, "grads": grads, "optimizer": opt, "hpz_secondary": hpz, "total": params + grads + opt + hpz}
