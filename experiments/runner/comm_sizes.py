"""What one collective call sends, read off its arguments: the bytes per peer of a
``torch.distributed`` call and of a functional collective op, and the names of both kinds.

``commwatch.CommWatch`` wraps the calls and counts what these functions read; the per-collective
rules (how an all-gather or a reduce-scatter splits its bytes among peers) are the library's
``zeropp.comm.stats.peer_bytes``, so a byte here means what it means in zeropp's own counters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zeropp.comm.stats import peer_bytes

WRAPPED = (
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
)


def tensor_bytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


def call_arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def call_peer_bytes(name: str, args: tuple, kwargs: dict, ranks: list[int], me: int) -> list[int]:
    """Bytes this rank sends to each group member (index = group rank) for one call: reads the
    message sizes off the call's arguments; the per-collective rules are zeropp.comm.stats.peer_bytes."""
    g = len(ranks)
    if g <= 1:
        return [0] * g
    kind, nbytes, splits, root = op_kind(name), 0, None, None
    if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        nbytes = tensor_bytes(call_arg(args, kwargs, 1, "input_tensor"))
    elif name == "all_gather":
        nbytes = tensor_bytes(call_arg(args, kwargs, 1, "tensor"))
    elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
        nbytes = tensor_bytes(call_arg(args, kwargs, 1, "input"))
    elif name == "reduce_scatter":
        splits = [tensor_bytes(t) for t in (call_arg(args, kwargs, 1, "input_list") or [])]
    elif name == "all_reduce":
        nbytes = tensor_bytes(call_arg(args, kwargs, 0, "tensor"))
    elif name == "all_to_all_single":
        inp = call_arg(args, kwargs, 1, "input")
        in_splits = call_arg(args, kwargs, 3, "input_split_sizes")
        nbytes = tensor_bytes(inp)
        if in_splits:
            per_row = nbytes // max(1, inp.shape[0]) if inp is not None and inp.dim() else 0
            splits = [int(s) * per_row for s in in_splits]
    elif name == "all_to_all":
        splits = [tensor_bytes(t) for t in (call_arg(args, kwargs, 1, "input_tensor_list") or [])]
    elif name in ("broadcast", "scatter", "reduce", "gather"):
        nbytes = tensor_bytes(call_arg(args, kwargs, 0, "tensor"))
        src = call_arg(
            args,
            kwargs,
            1 if name in ("broadcast", "reduce") else 2,
            "dst" if name in ("reduce", "gather") else "src",
            0,
        )
        if src not in ranks:
            return [0] * g
        root = ranks.index(src)
    return peer_bytes(kind, nbytes, g, splits=splits, rank=me, root=root)


def op_kind(name: str) -> str:
    return (
        name.lstrip("_").replace("_into_tensor", "").replace("_base", "").replace("_tensor", "").replace("_single", "")
    )


def functional_rule(op: str, args: tuple, kwargs: dict) -> tuple[str, Callable[[int, int], list[int]]]:
    """``(kind, per_peer)`` of one functional collective op (``op``: its name without namespace;
    ``args`` in the op's schema order): ``per_peer(group size, my group rank)`` is what this rank
    sends to each member, by the zeropp.comm.stats.peer_bytes rules. The input is a tensor, or a
    tensor list for ``*_coalesced`` (the sum of the per-tensor amounts)."""
    kind = FUNCTIONAL_KINDS[op]
    inp = args[0] if args else kwargs.get("input", kwargs.get("inputs"))
    tensors = list(inp) if isinstance(inp, (list, tuple)) else [inp]
    if op == "all_to_all_single":
        t, in_splits = tensors[0], call_arg(args, kwargs, 2, "input_split_sizes")
        assert t is not None, "all_to_all_single without an input tensor"
        row = tensor_bytes(t) // max(1, t.shape[0]) if t.dim() else 0
        splits = [int(x) * row for x in in_splits] if in_splits else None
        return kind, lambda g, me: peer_bytes(kind, tensor_bytes(t), g, splits=splits, rank=me)
    if kind == "broadcast":
        src = int(call_arg(args, kwargs, 1, "src"))  # a group rank
        return kind, lambda g, me: peer_bytes(kind, tensor_bytes(tensors[0]), g, rank=me, root=src)

    def per_peer(g: int, me: int) -> list[int]:
        return [sum(col) for col in zip(*(peer_bytes(kind, tensor_bytes(t), g, rank=me) for t in tensors))]

    return kind, per_peer


FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "shard_dim_alltoall": "all_to_all",
}
"""Functional collective op -> the kind it is counted as. ``shard_dim_alltoall`` (DTensor's
shard-dim change on GPUs) sends each peer its chunk of the input: an all-to-all."""


FUNCTIONAL_OPS = {
    "_c10d_functional": tuple(k for k in FUNCTIONAL_KINDS if k != "shard_dim_alltoall"),
    "_c10d_functional_autograd": ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"),
    "_dtensor": ("shard_dim_alltoall",),
}
"""The ops counted, by ``torch.ops`` namespace (those a torch version lacks are skipped)."""
