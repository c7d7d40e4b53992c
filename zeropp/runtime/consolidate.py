"""Plain weights back from a sharded engine: the unwrapped model's ``state_dict``.

Every unit's fp32 master is assembled whole (a replicated unit's is already whole; a sharded one
is all-gathered by the caller's ``gather``), split into parameters by the unit's layout and cast
to each parameter's original dtype. Frozen parameters come back unrounded (the originals the
engine kept when the compute-dtype cast rounds), buffers as they are. Everything lands on the CPU.
A tied parameter comes back under each of its names (separate tensors with equal values, as
``load_state_dict`` into the unwrapped, tied model expects).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import nn

from .partition import FlatUnit


@torch.no_grad()
def consolidated_state_dict(units: Sequence[FlatUnit],
                            masters: Union[Sequence[torch.Tensor], Callable[[int], torch.Tensor]],
                            gather: Callable[[FlatUnit, torch.Tensor], torch.Tensor], model: nn.Module,
                            param_dtypes: dict[str, torch.dtype], frozen_originals: dict[str, torch.Tensor]
                            ) -> dict[str, torch.Tensor]:
    """``masters`` gives each unit's fp32 master shard: a list, or ``masters(i)`` fetching it one
    unit at a time (an offloaded optimizer reads it back from host memory or disk, so only one
    unit's master is materialized at once). ``gather(unit, master_shard)`` returns the unit's full
    ``[padded]`` fp32 master (collective for sharded units, so every rank must call this)."""
    master = masters if callable(masters) else masters.__getitem__
    full_params: dict[str, torch.Tensor] = {}
    for i, u in enumerate(units):
        m = master(i)
        full = m if u.kind == "replicated" else gather(u, m)  # [padded]
        for name, t in u.unflatten(full).items():
            full_params[name] = t.to(dtype=param_dtypes[name], device="cpu").clone()
    # a tied parameter appears in state_dict under each of its names; the units and frozen_originals
    # know it by its first name in named_parameters(), so look every name up by the tensor's identity
    first = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        name = first.get(id(v), k)
        if k in full_params:
            out[k] = full_params[k]
        elif name in full_params:
            out[k] = full_params[name].clone()  # an alias not recorded in the layout: the same values
        elif name in frozen_originals:  # a frozen parameter in its original dtype, not the compute copy
            out[k] = frozen_originals[name].detach().to("cpu").clone()
        else:
            out[k] = v.detach().to("cpu").clone()
    return out
