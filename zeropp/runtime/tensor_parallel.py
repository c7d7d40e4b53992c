"""ZeRO-3 with tensor parallelism: a 2-D ``("dp", "tp")`` mesh, TP-split blocks, ZeRO over dp.

The largest models are trained with tensor parallelism inside a node and ZeRO across the rest
(``Topology(..., tp=2)``): every ``tp`` consecutive ranks of a node split each block's attention
heads and MLP width with torch's tensor-parallel plans (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, i.e. DTensor), and the engine shards, gathers and
reduces each rank's TP-local part over the data-parallel ranks sharing its tp index only
(``Topology.build``'s groups, ``EngineComm.group``), with qwZ / hpZ / qgZ applied there.

Design (why the parameters are plain tensors): after ``parallelize_module`` every split weight is
an ``nn.Parameter`` wrapping a ``DTensor``. The engine, though, binds each parameter's ``.data``
to a view of a flat buffer, frees it at stage 3, and flattens ``p.grad``; doing that to a DTensor
would touch every one of those places. Instead :func:`parallelize` replaces each DTensor parameter
by a plain ``nn.Parameter`` holding its local shard (``to_local()``) and registers a
``torch.nn.utils.parametrize`` parametrization that rebuilds the DTensor on every access
(``DTensor.from_local``, differentiable, no communication). The module still computes with
DTensor weights, the TP plans' input/output hooks do the tensor-parallel collectives, and the
engine sees ordinary parameters whose data and gradients are exactly the TP-local parts (the
gradient of a ``Replicate`` weight, e.g. a row-parallel bias, arrives already summed over tp by
``from_local``'s backward). The cost: the local parameter's name gains
``parametrizations.<name>.original``; :func:`full_state_dict` maps it back and reassembles full
weights (``DTensor.full_tensor``), which ``ZeroEngine.consolidated_state_dict`` returns.

The gradient norm of the whole model sums TP-sharded parameters' squares over tp and counts the
TP-replicated ones once (:func:`tp_sharded_mask`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.utils import parametrize

from zeropp.comm.topology import Topology

if TYPE_CHECKING:  # DTensor pulls in sympy (seconds per process): imported where used
    from torch.distributed.tensor import DTensor, Placement

MESH_DIMS = ("dp", "tp")
"""Names of the 2-D mesh's dimensions, outer to inner (tp = consecutive ranks inside a node)."""


@dataclasses.dataclass(frozen=True)
class TPInfo:
    """How a model was split (recorded on it by :func:`parallelize` as ``model.zeropp_tp``)."""

    mesh: DeviceMesh
    """The 2-D ``("dp", "tp")`` mesh."""
    tp: int
    """Tensor-parallel degree (``mesh["tp"].size()``)."""


class FromLocal(nn.Module):
    """Parametrization: the plain local shard -> the DTensor the TP plan made (no communication).

    ``interleave`` > 1 marks a fused projection (the GPT's ``qkv``) whose rows were reordered so
    that each rank's contiguous shard holds its heads of every one of the ``interleave`` parts;
    :func:`full_state_dict` undoes the reordering."""

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        shape: torch.Size,
        stride: tuple[int, ...],
        interleave: int = 1,
    ) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.mesh, self.placements, self.interleave = mesh, placements, interleave
        self.shape, self.stride = shape, stride  # of the global (DTensor) weight
        self._from_local = DTensor.from_local  # resolved once: forward runs at every weight access

    def forward(self, local: torch.Tensor) -> DTensor:
        return self._from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def make_mesh(topology: Topology, device_type: Optional[str] = None) -> DeviceMesh:
    """The ``("dp", "tp")`` mesh of ``topology`` (``world_size / tp`` x ``tp``; rank = dp * tp + t,
    so a tp group is ``tp`` consecutive ranks of one node). Collective over the default group."""
    if not isinstance(topology, Topology):
        raise TypeError(f"make_mesh expects a zeropp.comm.Topology, got {type(topology).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs torch.distributed initialised first")
    topology.check_world(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (topology.dp_size, topology.tp), mesh_dim_names=MESH_DIMS)


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` (the same on every rank, before any collective) unless ``model`` can be
    split ``tp`` ways: a known architecture whose heads, kv heads and MLP width ``tp`` divides."""
    from zeropp.models.gpt import GPT, check_gpt_tp
    from zeropp.models.hf import HFCausalLM, check_hf_tp

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive int")
    if isinstance(model, GPT):
        check_gpt_tp(model.cfg, tp)
    elif isinstance(model, HFCausalLM):
        check_hf_tp(model.cfg, tp)
    else:
        raise ValueError(
            f"tensor parallelism (tp={tp}) has plans for the built-in GPT and the Hugging Face Llama "
            f"only, not {type(model).__name__}; use topology.tp=1 for this model"
        )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split ``model``'s blocks over ``mesh["tp"]`` with its TP plan, then make every split weight
    a plain local parameter behind a :class:`FromLocal` parametrization (module docstring).
    Every rank must pass the same (identically initialised) model. Returns ``model``, changed in place."""
    from zeropp.models.gpt import GPT, parallelize_gpt
    from zeropp.models.hf import HFCausalLM, parallelize_hf

    if getattr(mesh, "mesh_dim_names", None) != MESH_DIMS:
        raise ValueError(
            f"parallelize needs a mesh with dimensions {MESH_DIMS} (make_mesh), got "
            f"{getattr(mesh, 'mesh_dim_names', None)}"
        )
    if getattr(model, "zeropp_tp", None) is not None:
        raise ValueError("this model was already split by parallelize(); build a fresh model")
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    check_tp(model, tp)  # before the plans' first collective
    if isinstance(model, GPT):
        parallelize_gpt(model, tp_mesh)
    else:
        assert isinstance(model, HFCausalLM)
        parallelize_hf(model, tp_mesh)
    _localize(model)
    model.zeropp_tp = TPInfo(mesh, tp)  # type: ignore[assignment]  # a plain attribute (torch's stub: tensors/modules)
    return model


def _localize(model: nn.Module) -> None:
    """Replace every DTensor parameter by its local shard behind a :class:`FromLocal` parametrization."""
    from torch.distributed.tensor import DTensor, Shard

    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                continue
            local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
            local.zeropp_tp_sharded = any(  # type: ignore[attr-defined]  # a marker read by is_tp_sharded
                isinstance(pl, Shard) for pl in p.placements
            )
            setattr(mod, name, local)  # replaces the registered DTensor parameter
            interleave = getattr(mod, "zeropp_tp_interleave", {}).get(name, 1)
            parametrize.register_parametrization(
                mod,
                name,
                FromLocal(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()), interleave),
                unsafe=True,
            )


def tp_info(model: nn.Module) -> Optional[TPInfo]:
    """How ``model`` was split by :func:`parallelize`, or None."""
    return getattr(model, "zeropp_tp", None)


def is_tp_sharded(p: torch.Tensor) -> bool:
    """True for the local part of a weight split over tp (its values differ between tp ranks)."""
    return bool(getattr(p, "zeropp_tp_sharded", False))


def is_tp_local(p: torch.Tensor) -> bool:
    """True for a parameter :func:`parallelize` made from a DTensor (split or replicated over tp)."""
    return hasattr(p, "zeropp_tp_sharded")


def check_model_matches(model: nn.Module, topology: Topology) -> None:
    """The engine's check: ``topology.tp`` > 1 needs a model split by :func:`parallelize` with the
    same tp, and a split model needs that topology (raised alike on every rank)."""
    info = tp_info(model)
    have = 1 if info is None else info.tp
    if have != topology.tp:
        if info is None:
            raise ValueError(
                f"topology.tp={topology.tp} but the model is not split: call "
                f"zeropp.runtime.tensor_parallel.parallelize(model, make_mesh(topology)) first"
            )
        raise ValueError(
            f"the model was split for tp={have} but the topology has tp={topology.tp}; pass the "
            f"Topology whose mesh split it"
        )


def tp_sharded_mask(
    params: list[torch.Tensor], offsets: list[tuple[int, int]], padded: int, device: torch.device
) -> torch.Tensor:
    """``[padded]`` bool: True where a flat unit's element belongs to a TP-sharded parameter
    (``offsets``: each parameter's ``(offset, numel)`` in the flat buffer)."""
    mask = torch.zeros(padded, dtype=torch.bool, device=device)
    for p, (off, n) in zip(params, offsets):
        if is_tp_sharded(p):
            mask[off : off + n] = True
    return mask


def _split_params(model: nn.Module) -> Iterator[tuple[str, str, FromLocal, torch.Tensor]]:
    """Every parameter :func:`parallelize` split: ``(local name, unsplit name, its FromLocal, the
    local tensor)``; the local name is the one ``named_parameters`` gives
    (``<module>.parametrizations.<name>.original``)."""
    for prefix, mod in model.named_modules():
        if not parametrize.is_parametrized(mod):
            continue
        for name, plist in mod.parametrizations.items():
            fl = plist[0]
            if isinstance(fl, FromLocal):
                head = f"{prefix}.{name}" if prefix else name
                local = f"{prefix}.parametrizations.{name}.original" if prefix else f"parametrizations.{name}.original"
                yield local, head, fl, plist.original


@torch.no_grad()
def full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's TP-local weights by parameter name, e.g. from the engine's dp
    consolidation) -> full weights under the unsplit model's names. Collective over every tp
    group (all-gathers), the same calls in the same order on every rank."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    for key, head, fl, original in _split_params(model):
        local = out.pop(key)
        full = DTensor.from_local(
            local.to(original.device), fl.mesh, fl.placements, run_check=False, shape=fl.shape, stride=fl.stride
        ).full_tensor()
        out[head] = _undo_interleave(full, fl.interleave, fl.mesh.size()).to(local.device, local.dtype)
    return out


def _undo_interleave(full: torch.Tensor, interleave: int, tp: int) -> torch.Tensor:
    """A fused projection's rows ``[tp, parts, n/tp]`` -> ``[parts, tp, n/tp]`` (the original order)."""
    if interleave == 1:
        return full
    rows = full.shape[0]
    return full.reshape(tp, interleave, rows // (interleave * tp), *full.shape[1:]).transpose(0, 1).reshape(full.shape)


def split_table(model: nn.Module) -> dict[str, dict]:
    """How each TP-local parameter of ``model`` maps back to the unsplit model, as JSON-able values
    (saved in a checkpoint's ``meta.json``, read by :func:`merge_pieces` without a process group):
    local name (``...parametrizations.<name>.original``) -> ``{"name": unsplit name, "dim": the split
    dimension or None for a weight replicated over tp, "interleave": fused parts}``."""
    from torch.distributed.tensor import Shard

    table: dict[str, dict] = {}
    for local, head, fl, _ in _split_params(model):
        dims = [pl.dim for pl in fl.placements if isinstance(pl, Shard)]
        table[local] = {"name": head, "dim": dims[0] if dims else None, "interleave": fl.interleave}
    return table


def merge_pieces(pieces: dict[str, list[torch.Tensor]], table: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The unsplit state dict from every tp rank's local state dict (``pieces``: name -> one tensor
    per tp index, in tp order) and the model's :func:`split_table`: split weights concatenated along
    their dimension (fused projections re-ordered), replicated ones taken from tp index 0. Local."""
    out: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        spec = table.get(name)
        if spec is None:  # not a TP-local parameter (embeddings, norms, buffers): the same on every tp rank
            out[name] = parts[0]
        elif spec["dim"] is None:
            out[spec["name"]] = parts[0]
        else:
            out[spec["name"]] = _undo_interleave(torch.cat(parts, dim=spec["dim"]), spec["interleave"], len(parts))
    return out


__all__ = [
    "MESH_DIMS",
    "FromLocal",
    "TPInfo",
    "check_model_matches",
    "check_tp",
    "full_state_dict",
    "is_tp_local",
    "is_tp_sharded",
    "make_mesh",
    "merge_pieces",
    "parallelize",
    "split_table",
    "tp_info",
    "tp_sharded_mask",
]
