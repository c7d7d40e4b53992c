"""Frozen parameters at stage 3: sharded like the rest, optionally stored quantized (MixZ++).

Why: fine-tuning (LoRA) trains a few adapter weights next to a large frozen base model. Kept
replicated, the base costs every rank its full size and gets none of ZeRO-3's savings. Here the
frozen floating-point parameters of each block (and of the root) form one extra flat unit of kind
``frozen`` (``partition.UnitLayout``): sharded over the world, gathered by the stage-3 hooks
together with the block's trainable unit (same prefetch and free schedule), but with no gradient,
no optimizer state and no reduce-scatter.

MixZ++ (``ZeroConfig.quantize_frozen=int8|int4``): frozen weights never change, so each rank
quantizes its shard ONCE, at construction, straight into the int codec's wire row (codes then
fp32 scales in one byte buffer, ``zeropp.comm.codecs.WireLayout``) and keeps only that. A gather
all-gathers those bytes as they are and dequantizes the received rows into the gather buffer:
nothing is re-quantized, so the values every forward and backward sees are exactly
``dequantize(quantize(w_shard))`` of each rank's shard, and the bytes on the wire and in memory are
the wire row's (about 1/2 of bf16 for INT8, 1/4 for INT4 at the default group size of 512).
qwZ does not apply to a quantized frozen unit (it is already quantized). hpZ does, in quantized
form: with ``ZeroConfig.hpz`` the first gather of a unit keeps this rank's slice of the gathered
wire rows (``W / h`` rows of the ``h`` ranks of its hpZ group, still INT8/INT4) as its secondary
copy, and every later gather, forward and backward, all-gathers those slices inside the node. Frozen
values never change, so the copy never goes stale: after the first forward no frozen byte crosses
a node (MixZ++ = quantized frozen weights + hpZ). Without quantization both qwZ and hpZ apply as to
trainable units, and the full-precision secondary of a frozen unit is likewise kept across steps.
A quantized gather is one message per unit (the bucket size is not applied: the wire row was cut
once, at construction). A checkpoint load drops every frozen secondary (:func:`store_shard`).

Values returned by ``consolidated_state_dict`` and saved in checkpoints: with ``none`` the exact
originals (a host copy of this rank's shard in the originals' dtype is kept when the cast to the
compute dtype rounds); with ``int8``/``int4`` the dequantized values, which is what the model
computes with. Loading a checkpoint re-quantizes the loaded shard once.

Offload (``ZeroConfig.offload_param=cpu|nvme``, ZeRO-Infinity): the stored shards -- compute
dtype or wire row -- live in the engine's ``offload.ParamStore`` like the trainable shards (pinned
host memory, or a region of the rank's ``params.swp``), and each gather copies the stored bytes to
the device first (:func:`stored`). hpZ's secondary copy stays on the device, as for trainable units.

Bytes: gathers are counted in ``CommStats`` under the kind ``frozen_all_gather`` (forward and
backward alike), per rank ``B`` (the wire row, or ``S`` elements of the compute dtype) to each other
member, as every all-gather (``zeropp.comm.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from zeropp.comm.codecs import codec_for
from zeropp.comm.kinds import CommKind
from zeropp.comm.spec import QuantSpec
from zeropp.kernels import DEFAULT_WEIGHT_GROUP_SIZE

from .blocks import span_name
from .collectives import EngineComm, Pending
from .partition import FlatUnit
from .units import Homes, assign_homes

KIND = CommKind.FROZEN_ALL_GATHER
"""``CommStats`` kind of every gather of a frozen unit (forward, backward)."""
BITS = {"none": None, "int8": 8, "int4": 4}
"""``ZeroConfig.quantize_frozen`` -> code width."""


@dataclass
class FrozenUnits:
    """The frozen units of one engine (stage 3; empty otherwise)."""

    blocks: list[tuple[nn.Module, FlatUnit]] = field(default_factory=list)
    """Block module -> its frozen unit, for the blocks that have frozen parameters, in block order
    (blocks coalesced into one unit each appear, with the same unit)."""
    root: FlatUnit | None = None
    """Frozen parameters outside the blocks (embeddings, final norm, head), or None."""
    order: list[nn.Module] = field(default_factory=list)
    """Every block module in forward order (to merge with the trainable blocks)."""
    spec: QuantSpec | None = None
    """How the shards are stored and gathered (None: the compute dtype)."""

    @property
    def units(self) -> list[FlatUnit]:
        return ([self.root] if self.root is not None else []) + list(dict.fromkeys(u for _, u in self.blocks))

    def param_ids(self) -> set[int]:
        return {id(p) for u in self.units for p in u.params}


def frozen_spec(quantize_frozen: str, group_size: int | None = None) -> QuantSpec | None:
    """The int codec's spec for ``quantize_frozen`` (``none`` -> None)."""
    if quantize_frozen not in BITS:
        raise ValueError(f"quantize_frozen={quantize_frozen!r}; use one of {tuple(BITS)}")
    bits = BITS[quantize_frozen]
    return None if bits is None else QuantSpec(bits=bits, group_size=group_size or DEFAULT_WEIGHT_GROUP_SIZE)


def build_frozen_units(
    model: nn.Module,
    *,
    block_modules: Sequence[nn.Module],
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    persistence_threshold: int = 0,
    spec: QuantSpec | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> FrozenUnits:
    """One ``frozen`` unit per block (``block<i>.frozen``; ``block<i>-<j>.frozen`` per coalesced
    span of ``spans``, the trainable units' :meth:`units.Homes.spans`; None: one per block) and for the root
    (``root.frozen``) holding the frozen floating-point parameters with at least
    ``persistence_threshold`` elements (smaller ones stay replicated, as trainable ones under the
    threshold do). Placement (block, root, tied names) is :func:`units.assign_homes`'s, the
    same as for the trainable units."""
    homes: Homes = assign_homes(model, block_modules)

    def frozen(p: nn.Parameter) -> bool:
        return not p.requires_grad and p.is_floating_point() and p.numel() >= max(1, persistence_threshold)

    def unit(name: str, ps: list[nn.Parameter]) -> FlatUnit:
        return homes.unit(name, ps, kind="frozen", num_shards=world_size, shard_rank=rank, dtype=dtype)

    out = FrozenUnits(order=list(homes.blocks), spec=spec)
    out.blocks = homes.span_units(spans, frozen, lambda first, last, ps: unit(f"{span_name(first, last)}.frozen", ps))
    root_ps = [p for p in homes.order if homes.home[id(p)] == Homes.ROOT and frozen(p)]
    out.root = unit("root.frozen", root_ps) if root_ps else None
    return out


def _wide_dtype(u: FlatUnit) -> torch.dtype:
    """The widest dtype of the unit's parameters: the originals' shard is kept in it."""
    out = u.params[0].dtype
    for p in u.params[1:]:
        out = torch.promote_types(out, p.dtype)
    return out


@torch.no_grad()
def store_shard(u: FlatUnit, shard: torch.Tensor, spec: QuantSpec | None) -> None:
    """Keep this rank's shard ``[S]`` (the originals' values) as the unit stores it: the int wire
    row ``uint8 [B]`` (quantized once, here) or the compute dtype, plus a host copy of the
    originals when that cast rounds (so exports are exact); then hand it to the unit's offload
    store, if it has one."""
    u.extra.pop("wire", None)
    u.extra.pop("original", None)
    u.param_shard = None
    u.secondary = None  # hpZ copy of the old values
    if spec is not None:
        codec = codec_for(spec)
        held = codec.encode(shard.float(), spec.bits, spec.group_size, rows=1, seed=None).view(-1)  # [B] uint8
        u.extra["wire"] = held
    else:
        held = u.param_shard = shard.to(u.dtype).clone()  # [S] compute dtype
        if shard.dtype != u.dtype and not torch.equal(held.to(shard.dtype), shard):
            u.extra["original"] = shard.to("cpu").clone()  # [S] originals' dtype, host memory
    u.extra["quantized"] = spec is not None
    u.extra["stored"] = (held.numel(), held.dtype)
    if u.extra.get("param_store") is not None:
        _offload(u, held)


def offload_frozen(fu: FrozenUnits) -> None:
    """``offload_param=cpu|nvme``: move every frozen unit's stored shard into the ``offload.ParamStore``
    the engine built with the frozen units (it marked them); later loads go there too (:func:`store_shard`)."""
    for u in fu.units:
        if u.extra.get("param_store") is not None:
            _offload(u, held(u))


def _offload(u: FlatUnit, t: torch.Tensor) -> None:
    """Hand the stored shard ``t`` to ``u``'s store: the unit then holds the host copy (cpu) or nothing (nvme)."""
    moved = u.extra["param_store"].keep(u, t)
    if is_quantized(u):
        u.extra["wire"] = moved
    else:
        u.param_shard = moved


@torch.no_grad()
def shard_frozen_units(fu: FrozenUnits) -> None:
    """Cut every frozen unit to this rank's shard (the parameters hold the full, already broadcast
    values) and free the full parameters."""
    for u in fu.units:
        full = u.flatten_data(_wide_dtype(u))  # [padded] originals' values
        a, b = u.shard_range()
        store_shard(u, full[a:b], fu.spec)
        del full
        u.release()


def is_quantized(u: FlatUnit) -> bool:
    return bool(u.extra.get("quantized"))


def held(u: FlatUnit) -> torch.Tensor | None:
    """The tensor holding ``u``'s stored shard in memory (device, or host with ``offload_param=cpu``;
    None on nvme): the wire row, or the compute-dtype shard."""
    return u.extra.get("wire") if is_quantized(u) else u.param_shard


def stored(u: FlatUnit) -> torch.Tensor:
    """``u``'s stored shard on its device (read back from host memory or the swap file when offloaded)."""
    store = u.extra.get("param_store")
    return store.fetch(u) if store is not None else held(u)


def stored_nbytes(u: FlatUnit) -> int:
    """Bytes of ``u``'s stored shard, on whichever tier it lives."""
    numel, dtype = u.extra["stored"]
    return numel * dtype.itemsize


def gather_quantized(
    comm: EngineComm,
    u: FlatUnit,
    out: torch.Tensor,
    spec: QuantSpec,
    *,
    kind: CommKind = KIND,
    async_op: bool,
    hpz: bool = False,
) -> Pending:
    """All-gather the stored wire rows of ``u`` as they are and dequantize them into ``out``
    (``[padded]``, any float dtype): rank ``r``'s rows land in ``out[r * S:(r + 1) * S]``.
    ``hpz``: from the unit's quantized secondary copy inside the hpZ group when it has one, else
    over the world, keeping this rank's slice of the gathered rows as that copy (module docstring)."""
    from_secondary = hpz and u.secondary is not None  # [W / h * B]: rows of hpZ member k's share of the world
    keep = hpz and u.secondary is None

    def on_rows(recv: torch.Tensor) -> None:  # the first gather keeps its share, quantized, never stale
        u.secondary = comm.hpz_share(recv)

    return comm.all_gather_rows(
        out,
        u.secondary if from_secondary else stored(u),  # [B] uint8 (on the device) over the world
        spec=spec,
        hpz=from_secondary,
        kind=kind,
        unit=u.name,
        async_op=async_op,
        on_rows=on_rows if keep else None,
    )


def gather_bytes(u: FlatUnit, world_size: int, element_size: int) -> int:
    """Bytes this rank sends in one gather of ``u`` (to all the other members together)."""
    per_peer = stored_nbytes(u) if is_quantized(u) else u.shard_numel * element_size
    return per_peer * (world_size - 1)


@torch.no_grad()
def full_values(
    comm: EngineComm, fu: FrozenUnits, param_dtypes: dict[str, torch.dtype], *, bucket: int
) -> dict[str, torch.Tensor]:
    """Every frozen unit's full values (collective), ``{canonical name: tensor}`` on the CPU in each
    parameter's own dtype: the exact originals, or the dequantized values when quantized."""
    out: dict[str, torch.Tensor] = {}
    for u in fu.units:
        if is_quantized(u):
            full = torch.empty(u.padded, dtype=torch.float32, device=u.device)  # [padded]
            gather_quantized(comm, u, full, fu.spec, kind=CommKind.CHECKPOINT, async_op=False)
        else:
            shard = u.extra.get("original")
            shard = shard.to(u.device) if shard is not None else stored(u)  # [S]
            full = torch.empty(u.padded, dtype=shard.dtype, device=u.device)  # [padded]
            comm.all_gather(
                full, shard, spec=None, bucket=bucket, kind=CommKind.CHECKPOINT, unit=u.name, async_op=False
            )
        for s in u.slots:  # canonical names only, as named_parameters() (a tied weight once)
            t = full[s.offset : s.offset + s.numel].view(s.shape)
            out[s.name] = t.to(dtype=param_dtypes.get(s.name, t.dtype), device="cpu").clone()
    return out


@torch.no_grad()
def load_values(fu: FrozenUnits, values: dict[str, torch.Tensor]) -> None:
    """Replace every frozen unit's shard by this rank's part of ``values`` (full tensors by name, as
    :func:`full_values` returns; local). Quantized units quantize the new shard once."""
    for u in fu.units:
        wide = torch.float32
        for s in u.slots:
            wide = torch.promote_types(wide, values[s.name].dtype)
        full = torch.zeros(u.padded, dtype=wide, device=u.device)  # [padded]
        for s in u.slots:
            full[s.offset : s.offset + s.numel].copy_(values[s.name].reshape(-1))
        a, b = u.shard_range()
        store_shard(u, full[a:b], fu.spec)


def held_bytes(u: FlatUnit) -> int:
    """Bytes of ``u``'s stored shard held in memory (device, or host when offloaded to cpu; 0 on nvme)."""
    t = held(u)
    return 0 if t is None else t.numel() * t.element_size()


def host_bytes(u: FlatUnit) -> int:
    """Bytes of the host copy of the originals' shard (kept when the compute-dtype cast rounds)."""
    t = u.extra.get("original")
    return 0 if t is None else t.numel() * t.element_size()


def frozen_bytes(fu: FrozenUnits) -> int:
    """This rank's frozen-weight bytes (all frozen units' stored shards, on whichever tier)."""
    return sum(stored_nbytes(u) for u in fu.units)
