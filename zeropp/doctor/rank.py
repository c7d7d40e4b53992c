"""One rank of a doctor world (``python -m zeropp.doctor.rank``, started by ``world.py``).

In the world each rank checks, against results it computes itself from every rank's
deterministic input: the plain all-gather (exact), the plain sum reduce-scatter (fp32 rounding
only), and the same two through zeropp's INT8 quantized collectives (``zeropp.comm``), whose
distance from the plain results must stay within the quantization error bound (half a
quantization step of the largest block, per input). The rank prints JSON lines on stdout
(``started``, ``init``, then ``done`` with its checks or ``error`` with the phase) and destroys
its process group before it exits. Kept out of the package's imports, so that ``-m`` runs it
fresh.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch

from zeropp.comm import QuantSpec, quantized_all_gather, quantized_reduce_scatter
from zeropp.interrupts import end_start_up

ELEMENTS = 4099
"""Elements of each rank's shard: several quantization blocks, the last one partial."""


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _inputs(rank: int, n: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard ([n]) and gradient ([world * n]), the same wherever computed."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g), torch.randn(world * n, generator=g) * (1 + rank)


def half_step(x: torch.Tensor) -> float:
    """The largest error INT8 round-to-nearest may make on ``x``: half a step of its largest block
    (absmax / 127 / 2), plus 4 fp32 ulps of absmax for the rounded scale and product."""
    amax = x.abs().max().item()
    return amax / 127 / 2 + 4 * amax * 2**-23


def _compare(got: torch.Tensor, want: torch.Tensor, bound: float) -> dict[str, Any]:
    err = (got.float().cpu() - want).abs().max().item()
    ok = err <= bound
    return {"ok": ok, "error": err, "bound": bound, "detail": f"max error {err:.3g} (bound {bound:.3g})"}


def rank_checks(rank: int, world: int, device: torch.device, n: int = ELEMENTS) -> dict[str, dict[str, Any]]:
    """The collective checks of one rank in an initialized world (see the module docstring)."""
    everyone = [_inputs(r, n, world) for r in range(world)]
    shard, grad = (t.to(device) for t in everyone[rank])
    want_gather = torch.cat([s for s, _ in everyone])
    want_sum = torch.stack([g for _, g in everyone]).sum(0)[rank * n : (rank + 1) * n]
    # per input, half a quantization step of the largest block (INT8: absmax / 127 / 2), plus
    # fp32 rounding of the scale and of code * scale (a few ulps of absmax)
    step = [half_step(g) for _, g in everyone]
    out: dict[str, dict[str, Any]] = {}
    full = torch.empty(world * n, device=device)
    quantized_all_gather(full, shard)
    out["all_gather"] = _compare(full, want_gather, 0.0)
    mine = torch.empty(n, device=device)
    quantized_reduce_scatter(mine, grad, op=torch.distributed.ReduceOp.SUM)
    fp32_slack = 1e-5 * want_sum.abs().max().item() * world
    out["reduce_scatter"] = _compare(mine, want_sum, fp32_slack)
    qfull = torch.empty(world * n, device=device)
    quantized_all_gather(qfull, shard, spec=QuantSpec(bits=8))
    gather_bound = max(half_step(s) for s, _ in everyone)
    out["quantized_all_gather"] = _compare(qfull, full.cpu(), gather_bound)
    qmine = torch.empty(n, device=device)
    quantized_reduce_scatter(qmine, grad, op=torch.distributed.ReduceOp.SUM, spec=QuantSpec(bits=8))
    out["quantized_reduce_scatter"] = _compare(qmine, mine.cpu(), sum(step) + 2 * fp32_slack)
    return out


def rank_main() -> int:
    """One rank of a doctor world (environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    ZEROPP_DOCTOR_BACKEND, ZEROPP_DOCTOR_TIMEOUT_S). Exit status 0 when it reported its checks."""
    import torch.distributed as dist

    end_start_up()  # a SIGTERM during the rendezvous or a collective (waits in C) ends the rank at once
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ["ZEROPP_DOCTOR_BACKEND"]
    timeout = datetime.timedelta(seconds=float(os.environ["ZEROPP_DOCTOR_TIMEOUT_S"]))
    _emit(event="started", rank=rank)
    phase = "init"
    try:
        device = torch.device("cpu")
        kw: dict[str, Any] = {}
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            kw["device_id"] = device  # eager init: the communicator is built (and can fail) here
        t0 = time.perf_counter()
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        try:
            dist.barrier()
            _emit(event="init", seconds=time.perf_counter() - t0)
            phase = "collectives"
            checks = rank_checks(rank, world, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except Exception as err:
        _emit(event="error", phase=phase, error=f"{type(err).__name__}: {str(err).strip()[:1000]}")
        return 1
    _emit(event="done", checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
