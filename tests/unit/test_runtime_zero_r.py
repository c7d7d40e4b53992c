"""ZeRO-R: activation checkpointing, activation offload and the constant buffer pool.

Reference: the same engine without the feature. In fp32 the recomputation runs the same kernels
on the same inputs and the re-gathered block holds the same values (hpZ: the same secondary
copy; qwZ: the same deterministic quantization of the same shard), so losses and final weights
must be *equal*, not close, at every stage and with hpZ, qwZ and qgZ. Offloading copies saved
activations to the host and back, bit for bit, so it is exact too.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_zero_r.py``, ``tests/gpu/test_runtime_zero_r.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.runtime_helpers import check_offload_model_host_bytes


@pytest.mark.parametrize("offload", [False, True])
def test_store_counts_tiers_and_gives_exact_gradients(offload):
    """Single process, against plain autograd: saved activations are counted on the tier they
    live on (parameters are not activations), and the gradients are bit-identical."""
    from zeropp.runtime.activations import ActivationStore

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    store = ActivationStore(torch.device("cpu"), offload=offload)
    with store.saving():
        y = torch.tanh(lin(x * 2)).sum()
    y.backward()
    saved = 2 * 3 * 8 * 4  # linear's input and tanh's output, [3, 8] fp32 each; the weight is a parameter
    want = {"device": 0, "host": saved} if offload else {"device": saved, "host": 0}
    assert store.memory_by_tier() == dict(want, disk=0)
    ref = nn.Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    x2 = x.detach().clone().requires_grad_()
    torch.tanh(ref(x2 * 2)).sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(x.grad, x2.grad)


def test_store_rederives_parameter_views_from_the_current_binding():
    """Stage 3 frees a block's buffer after its forward and binds a re-gathered one before its
    backward: a saved ``weight.t()`` must read the re-gathered buffer, not pin the old one."""
    import weakref

    from zeropp.runtime.activations import ActivationStore

    lin = nn.Linear(4, 4, bias=False)
    w0 = lin.weight.detach().clone()
    forward_buf = torch.empty(16)
    forward_buf.copy_(w0.reshape(-1))
    lin.weight.data = forward_buf.view(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    store = ActivationStore(torch.device("cpu"))
    with store.saving():
        y = lin(x).sum()
    gone = weakref.ref(forward_buf)
    lin.weight.data = torch.empty(0)  # "released"
    del forward_buf
    assert gone() is None  # nothing saved keeps the forward buffer alive
    lin.weight.data = (2 * w0).clone()  # "re-gathered" (different values, to see which one is used)
    y.backward()
    assert torch.equal(x.grad, (2 * w0).sum(0).expand(2, 4))


def _saved_bytes(
    fn, *inputs: torch.Tensor
) -> tuple[dict[str, int], dict[str, int], list[torch.Tensor], list[torch.Tensor]]:
    """Run ``fn(*inputs).sum()`` backward under a device-path and an offloading store, and under
    plain autograd: (device tiers, offload tiers, offload grads, plain grads) of ``inputs``."""
    from zeropp.runtime.activations import ActivationStore

    grads, tiers = [], []
    for offload in (False, True):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        store = ActivationStore(torch.device("cpu"), offload=offload)
        with store.saving():
            y = fn(*xs).sum()
        y.backward()
        tiers.append(store.memory_by_tier())
        grads.append([x.grad for x in xs])
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    fn(*xs).sum().backward()
    return tiers[0], tiers[1], grads[1], [x.grad for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offload_copies_a_storage_saved_through_two_views_once(dtype):
    """``sin`` saves ``y`` and ``mm`` saves the view ``y.t()`` (as an attention block's linear saves
    a view of the SDPA output SDPA saved): one host copy, as many bytes as the device path, and
    gradients bit-identical to plain autograd."""
    torch.manual_seed(0)
    x = torch.randn(7, 17).to(dtype)
    w = torch.randn(7, 5).to(dtype)

    def fn(x, w):
        y = x * 2  # [7, 17]; saved twice below, through two views
        return y.sin().sum() + (y.t() @ w).sum()  # mm saves y.t() (for w's grad) and w (for y's)

    dev, host, got, want = _saved_bytes(fn, x, w)
    item = x.element_size()
    assert dev == {"device": (7 * 17 + 7 * 5) * item, "host": 0, "disk": 0}
    assert host == {"device": 0, "host": dev["device"], "disk": 0}
    for g, r in zip(got, want):
        assert torch.equal(g, r)


def test_offload_copies_a_small_view_of_a_large_storage_alone():
    """One column of a [64, 64] storage: the view is copied (64 elements), not its whole span."""
    x = torch.randn(64, 64)
    dev, host, got, want = _saved_bytes(lambda x: (x * 2)[:, 3].sin(), x)
    assert dev["device"] == 64 * 64 * 4 and host["host"] == 64 * 4
    assert torch.equal(got[0], want[0])


def test_offload_of_strided_views_covering_a_storage_copies_it_once():
    """``q``, ``k``, ``v``: three column blocks of one [17, 3 * 7] storage, each alone a sparse view
    of it (copied on its own), together covering it: the storage is copied once, the views' own
    copies dropped, and the host holds the device path's bytes."""
    torch.manual_seed(1)
    x = torch.randn(17, 21)

    def fn(x):
        q, k, v = (x * 2).split(7, dim=1)  # each [17, 7], stride (21, 1)
        return q.sin() + k.cos() * v.sin()  # saves q, k, v and the product's operands (own storages)

    dev, host, got, want = _saved_bytes(fn, x)
    assert dev["device"] == (17 * 21 + 2 * 17 * 7) * 4  # the qkv storage, k.cos(), v.sin()
    assert host["host"] == dev["device"]

    # q and k only: their span (up to k's last element, rounded to 16 bytes) is copied, not v's tail
    dev, host, got, want = _saved_bytes(lambda x: (lambda q, k, v: q.sin() + k.cos())(*(x * 2).split(7, dim=1)), x)
    assert dev["device"] == 17 * 21 * 4 and host["host"] == -(-(16 * 21 + 14) * 4 // 16) * 16
    assert torch.equal(got[0], want[0])


def test_offload_model_host_bytes_equal_device_bytes():
    check_offload_model_host_bytes("cpu")  # on CUDA: tests/gpu/test_runtime_zero_r.py


def test_offload_never_serves_a_storage_modified_after_saving_stale():
    """``y`` saved, modified in place, saved again: the second save gets its own copy (the
    version differs), and each backward reads the values saved at its own save, as the
    out-of-place reference computes. A tensor freed and its address reused is not mistaken for
    the previous one either (the entry's holder is dead)."""
    torch.manual_seed(2)
    x = torch.randn(7, 17)

    def inplace(x):
        y = x * 2
        a = y.sin()  # saves y at version 0
        y.mul_(3)
        return a + y.cos()  # saves y at version 1

    def out_of_place(x):
        y0 = x * 2
        return y0.sin() + (y0 * 3).cos()

    from zeropp.runtime.activations import ActivationStore

    # the device path and plain autograd refuse this (torch's saved-tensor version check), the
    # host copies hold each save's values, so compare against the out-of-place computation
    x1 = x.clone().requires_grad_()
    store = ActivationStore(torch.device("cpu"), offload=True)
    with store.saving():
        y = inplace(x1).sum()
    y.backward()
    assert store.memory_by_tier()["host"] == 2 * 7 * 17 * 4
    x2 = x.clone().requires_grad_()
    out_of_place(x2).sum().backward()
    assert torch.equal(x1.grad, x2.grad)

    # an address freed and reused in one forward (by a new tensor at version 0): simulated with two
    # tensors on one numpy buffer; the first is dead when the second is saved, so its copy is not reused
    arr = np.empty((7, 17), dtype=np.float32)
    w = torch.randn(7, 17, requires_grad=True)
    vals = [torch.randn(7, 17) for _ in range(2)]
    store = ActivationStore(torch.device("cpu"), offload=True)
    with store.saving():
        total = 0
        for v in vals:
            arr[:] = v.numpy()  # untracked by torch, as a reallocation would be
            t = torch.from_numpy(arr)  # same address, version 0
            total = total + (t * w).sum()  # saves t
            del t
    total.backward()
    assert store.memory_by_tier()["host"] == 2 * 7 * 17 * 4
    assert torch.equal(w.grad, vals[0] + vals[1])
