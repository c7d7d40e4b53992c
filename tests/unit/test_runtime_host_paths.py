"""The runtime's short host paths give what the general paths give.

Stage 3 binds, flattens and saves tensors many times per step, so those paths skip work the
general ones do (views made once per pool slot, one ``_foreach_copy_`` instead of a ``cat`` of
flattened gradients, plain tensors' attributes read directly when packing saved tensors). Each
test compares a short path with the general one, or with the rule it replaces.
"""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
import torch
from torch import nn

from zeropp.runtime.activations import ActivationStore, _is_dtensor, _is_parameter, _view_base
from zeropp.runtime.buffers import BufferPool
from zeropp.runtime.partition import FlatUnit

CPU = torch.device("cpu")


class _SubParam(nn.Parameter):
    """A Parameter subclass (its type is not ``nn.Parameter`` itself)."""


class _Sub(torch.Tensor):
    """A tensor subclass (the general path reads its attributes through ``__torch_function__``)."""


def _general_pack(store: ActivationStore, t: torch.Tensor) -> tuple:
    """``ActivationStore._pack`` as written before its plain-tensor reads (no offload, no DTensor)."""
    assert not _is_dtensor(t)
    base = _view_base(t)
    if base is None and store.storage_params:
        base = store._param_by_storage(t)
    base = t if base is None else base
    if isinstance(base, nn.Parameter):
        if t is base:
            return ("param", base)
        return ("param_view", base, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
    store._device_storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return ("device", t)


def _flagged() -> torch.Tensor:
    """A plain tensor carrying torch's parameter flag (what ``Parameter`` sets on custom tensors)."""
    t = torch.zeros(3, 4)
    cast(Any, t)._is_param = True
    return t


def _tensors() -> dict[str, torch.Tensor]:
    p = nn.Parameter(torch.randn(4, 6))
    act = torch.randn(5, 6, requires_grad=True) * 2  # a non-leaf activation
    sub_p = _SubParam(torch.randn(3, 3))
    sub = torch.randn(6, 2).as_subclass(_Sub)
    flag_param = nn.Parameter(torch.randn(2, 5).as_subclass(_Sub))  # a custom tensor: flagged, not a Parameter
    flagged = _flagged()
    return {
        "parameter": p,
        "parameter.t()": p.t(),
        "parameter row": p[1],
        "activation": act,
        "activation.t()": act.t(),
        "activation slice": act[1:3, ::2],
        "leaf tensor": torch.randn(3),
        "Parameter subclass": sub_p,
        "Parameter subclass view": sub_p.t(),
        "tensor subclass": sub,
        "tensor subclass view": sub.t(),
        "flagged custom tensor": flag_param,
        "flagged custom tensor view": flag_param.t(),
        "flagged plain tensor": flagged,
        "flagged plain tensor view": flagged.t(),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_is_parameter_is_isinstance(name: str) -> None:
    t = _tensors()[name]
    assert _is_parameter(t) == isinstance(t, nn.Parameter)
    base = _view_base(t)
    if base is not None:
        assert _is_parameter(base) == isinstance(base, nn.Parameter)


@pytest.mark.parametrize("with_storage_params", [False, True], ids=["plain", "storage-params"])
def test_pack_gives_the_general_paths_packed_tuples(with_storage_params: bool) -> None:
    """Every kind of saved tensor packs to the same tuple (the same objects in it) and the same
    device-storage account as the general path, with and without tensor parallelism's storage
    parameters (an alias without a view base, resolved by storage)."""
    tensors = _tensors()
    fast, general = ActivationStore(CPU), ActivationStore(CPU)
    if with_storage_params:
        p = cast(nn.Parameter, tensors["parameter"])
        fast.storage_params = general.storage_params = [p]
        alias = torch.empty(0).set_(p.untyped_storage(), 6, (6,), (1,))  # row 1, no _base
        tensors["storage alias"] = alias
    for name, t in tensors.items():
        got, want = fast._pack(t), _general_pack(general, t)
        assert len(got) == len(want) and got[0] == want[0], name
        assert all(a is b or a == b for a, b in zip(got, want)), name
    assert fast._device_storages == general._device_storages


def test_pool_acquire_picks_as_the_rule_says() -> None:
    """Over a random sequence of acquires and gives back, the slot handed out is the smallest
    free one that fits and, among equal ones, the last given back (a new slot when none fits);
    the same slot and size come back as the same tensor object."""
    rng = random.Random(0)
    pool = BufferPool(torch.float32, CPU)
    pool.reserve("r", 2, 8)
    pool.reserve("r", 2, 16)
    held: list[torch.Tensor] = []
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for _ in range(300):
        if held and (rng.random() < 0.5 or len(held) > 5):
            pool.give_back(held.pop(rng.randrange(len(held))))
            continue
        numel = rng.choice([1, 5, 8, 12, 16, 20])
        slots, free = pool._slots["r"], list(pool._free["r"])
        fits = [pos for pos, k in enumerate(free) if slots[k].numel() >= numel]
        want = free[min(fits, key=lambda pos: (slots[free[pos]].numel(), -pos))] if fits else len(slots)
        buf = pool.acquire("r", numel)
        assert buf.numel() == numel and buf.data_ptr() == pool._slots["r"][want].data_ptr()
        assert seen.setdefault((want, numel), buf) is buf
        held.append(buf)
    assert pool.allocations == len(pool._slots["r"])


def test_pool_views_are_reused_for_pool_buffers_only() -> None:
    shapes = [(), (3, 0, 5), (17, 3), (7,)]
    named = [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    u = FlatUnit.build("u", named, kind="sharded", num_shards=2, shard_rank=0, dtype=torch.float32)
    pool = BufferPool(torch.float32, CPU)
    buf = pool.acquire("gather", u.padded)
    views = pool.views(buf, u.layout.views)
    for s, v in zip(u.slots, views):
        want = buf[s.offset : s.offset + s.numel].view(s.shape)
        assert (v.shape, v.stride(), v.storage_offset(), v.data_ptr()) == (
            want.shape,
            want.stride(),
            want.storage_offset(),
            want.data_ptr(),
        )
    pool.give_back(buf)
    again = pool.acquire("gather", u.padded)
    assert again is buf and pool.views(again, u.layout.views) is views
    other = torch.zeros(u.padded)  # not the pool's: fresh views, nothing kept
    assert pool.views(other, u.layout.views) is not pool.views(other, u.layout.views)
    assert all(k[0] != id(other) for k in pool._views)
    u.bind(again, views)
    assert all(p.data_ptr() == v.data_ptr() and p.shape == v.shape for p, v in zip(u.params, views))
    u.release()
    assert all(p.numel() == 0 for p in u.params)
    empty = u.params[0].data
    u.bind(again)
    u.release()
    assert all(p.untyped_storage().data_ptr() == empty.untyped_storage().data_ptr() for p in u.params)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous-grads", "column-major-grads"])
def test_flatten_grads_into_pool_views_is_the_cat(contiguous: bool) -> None:
    """The ``_foreach_copy_`` into the parameters' views of a pool buffer writes the bits the
    ``cat`` of the flattened gradients writes, the padding zeroed, in a buffer holding old values."""
    shapes = [(5,), (4, 6), (), (3, 7)]
    named = [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    u = FlatUnit.build("u", named, kind="sharded", num_shards=4, shard_rank=0, dtype=torch.float32)
    assert u.padded > u.numel
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    if not contiguous:
        grads = [g.t().contiguous().t() if g.dim() == 2 else g for g in grads]
    pool = BufferPool(torch.float32, CPU)
    out = pool.acquire("grad_flat", u.padded)
    out.fill_(float("nan"))
    for p, g in zip(u.params, grads):
        p.grad = g
    got = u.flatten_grads(out=out, views=pool.views(out, u.layout.views)).clone()
    assert all(p.grad is None for p in u.params)
    for p, g in zip(u.params, grads):
        p.grad = g
    want = u.flatten_grads(out=torch.full((u.padded,), float("nan")))
    assert torch.equal(got, want)
