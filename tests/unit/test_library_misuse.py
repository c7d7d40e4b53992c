"""A researcher's own script off the happy path, one process: what ``ZeroEngine`` refuses before
any collective, and the kernels' argument checks.

Engines are built on a fake process group (``plan_helpers.fake_world``): each refusal comes before
anything is sent, so it needs no peers. The gloo-world checks of this topic (the model's
``state_dict`` / ``load_state_dict``, a parameter added after wrapping, integer averages, the DDP
hook after ``destroy_process_group``) are in ``tests/distributed/test_library_misuse.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.plain_models import mlp
from tests.plan_helpers import fake_world
from zeropp.comm import Topology
from zeropp.kernels import dequantize, hadamard, quantize
from zeropp.runtime import ZeroConfig, ZeroEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: nn.Module, stage: int, **kw: object) -> ZeroEngine:
    return ZeroEngine(model, config=ZeroConfig(stage=stage, **kw), topology=Topology.single_node(2))  # type: ignore[arg-type]


def test_a_persistence_threshold_above_every_parameter_is_refused_by_the_engine() -> None:
    """The runner refuses it before any rank starts; a direct ``ZeroEngine`` used to accept it and
    train every parameter replicated (stage 0's memory) under stage 3's name."""
    largest = max(p.numel() for p in mlp().parameters())  # 64: the weights of the 8x8 Linears
    with fake_world(0, 2):
        with pytest.raises(
            ValueError,
            match=rf"persistence_threshold=100000 is above every parameter .*the largest, '0.weight', has "
            rf"{largest} elements.*Lower persistence_threshold to at most {largest} \(0 shards every parameter\), "
            r"or use stage=0",
        ):
            _engine(mlp(), 3, persistence_threshold=100_000)
        # at the largest parameter's size it is sharded, the smaller ones (biases) stay whole
        eng = _engine(mlp(), 3, persistence_threshold=largest)
        try:
            assert eng.persistent is not None and {s.name for s in eng.persistent.slots} == {
                "0.bias",
                "2.bias",
                "4.bias",
            }
            assert [u.kind for u in eng.units if u is not eng.persistent] == ["sharded"] * 3
        finally:
            eng.close()


def test_a_model_another_engine_holds_is_refused_before_anything_is_sent() -> None:
    with fake_world(0, 2):
        m = mlp()
        first = _engine(m, 1)
        with pytest.raises(ValueError, match=r"Sequential is wrapped by an open ZeroEngine \(stage 1\).*close\(\)"):
            _engine(m, 1)
        first.close()
        _engine(m, 1).close()  # stages 0-2 leave real weights behind: wrapping again after close() works
        m3 = mlp()
        _engine(m3, 3).close()
        with pytest.raises(ValueError, match=r"wrapped by a ZeroEngine at stage 3.*empty shards.*build a fresh model"):
            _engine(m3, 3)


def test_an_engine_used_after_destroy_process_group_says_so() -> None:
    """Before: ``ValueError: Default process group has not been initialized, please make sure to call
    init_process_group`` (the user had), or, after a new ``init_process_group``, calls on the old
    world's destroyed groups."""
    with fake_world(0, 2):
        eng = _engine(mlp(), 3)
    msg = r"process group this ZeroEngine was built on was destroyed .*build a new model and a new ZeroEngine"
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match=msg):
        eng.train_step([x])
    with pytest.raises(RuntimeError, match=msg):
        eng.eval_loss(x)
    with fake_world(0, 2), pytest.raises(RuntimeError, match=msg):
        eng.train_step([x])
    eng.close()  # local: still fine


def test_kernel_arguments_of_the_wrong_type_are_one_clear_line() -> None:
    """``bits=8.0`` equals 8, passed the check and failed sizing a tensor (``TypeError: empty():
    argument 'size' failed to unpack ...``); ``rows=2.0`` likewise (``empty() takes 1 positional
    argument but 2 were given``); ``stochastic="no"`` failed with ``invalid literal for int()``; a
    list with ``'list' object has no attribute 'is_cuda'``."""
    x = torch.randn(300)
    with pytest.raises(ValueError, match=r"rows must be a positive int, got 2.0"):
        quantize(x, rows=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rows must be a positive int, got 2.0"):
        hadamard(torch.randn(32), 16, rows=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"stochastic must be True or False, got 'no'"):
        quantize(x, stochastic="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"quantize takes a torch.Tensor, got list"):
        quantize([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bits=8.0 is not supported by the quantization kernels; use an int"):
        quantize(x, bits=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bits=True is not supported"):
        quantize(x, bits=True)
    assert torch.equal(dequantize(quantize(x, bits=8)), dequantize(quantize(x, bits=torch.tensor(8).item())))


def test_a_model_without_trainable_parameters_or_a_torch_optimizer_is_refused() -> None:
    """Before: a frozen model failed in its first backward with torch's ``element 0 of tensors does
    not require grad``; ``optimizer=torch.optim.SGD`` was taken and failed at the first step."""
    frozen = mlp().requires_grad_(False)
    with fake_world(0, 2):
        with pytest.raises(ValueError, match=r"Sequential has no trainable parameter .*unfreeze the parameters"):
            _engine(frozen, 3)
        with pytest.raises(TypeError, match=r"optimizer must be a zeropp.runtime.OptimizerConfig .*got <class"):
            ZeroEngine(mlp(), optimizer=torch.optim.SGD)  # type: ignore[arg-type]


def test_a_model_on_the_meta_device_is_refused_before_anything_is_sent() -> None:
    """Before: the engine broadcast and sharded the shapes, and the first forward failed with
    ``Tensor on device meta is not on the expected device cpu!`` and a hint about parameters shared
    across blocks."""
    with torch.device("meta"):
        m = mlp()
    with fake_world(0, 2), pytest.raises(ValueError, match=r"Sequential's '0.weight' is on the meta device .*to_empty"):
        _engine(m, 3)


def test_train_step_under_no_grad_is_refused_before_anything_is_sent() -> None:
    with fake_world(0, 2):
        eng = _engine(mlp(), 3)
        try:
            with torch.no_grad(), pytest.raises(RuntimeError, match=r"train_step was called under torch.no_grad\(\)"):
                eng.train_step([torch.zeros(4, 8)])
        finally:
            eng.close()


def test_stage3_state_dict_is_refused_on_every_submodule_and_after_close() -> None:
    """Before: only the root module was hooked, so ``model.inner.state_dict()`` (or a ``transformers``
    model's ``save_pretrained``, which reads its own ``state_dict``) returned empty ``(0,)`` tensors,
    and after ``close()`` the hook was gone and ``torch.save(model.state_dict(), f)`` saved them."""
    m = nn.Sequential(mlp())
    fresh = nn.Sequential(mlp()).state_dict()
    with fake_world(0, 2):
        eng = _engine(m, 3)
    try:
        with pytest.raises(RuntimeError, match=r"stage 3 would hold empty tensors.*consolidated_state_dict"):
            m[0].state_dict()
        with pytest.raises(RuntimeError, match=r"stage 3 would hold empty tensors"):
            m[0][2].state_dict()
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) on a model ZeroEngine wraps \(stage 3\)"):
            m[0].load_state_dict({k[2:]: v for k, v in fresh.items()})
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match=r"after engine.close\(\).*consolidated_state_dict\(\).*before close\(\)"):
        m.state_dict()
    with pytest.raises(RuntimeError, match=r"after engine.close\(\)"):
        m[0].state_dict()
    with torch.no_grad():  # parameters given their values again (e.g. from consolidated_state_dict): readable
        for n, p in m.named_parameters():
            p.set_(fresh[n].clone())
    assert all(torch.equal(v, fresh[k]) for k, v in m.state_dict().items())


def test_stage3_save_pretrained_of_a_wrapped_hf_model_is_refused(tmp_path: object) -> None:
    pytest.importorskip("transformers")
    from zeropp.models import HFConfig, build_hf_model

    m = build_hf_model(HFConfig(hf_config="llama", d_model=32, seq_len=32, n_layers=2), seed=0)
    with fake_world(0, 2):
        eng = _engine(m, 3)
    try:
        with pytest.raises(RuntimeError, match=r"stage 3 would hold empty tensors"):
            m.hf.save_pretrained(str(tmp_path))
    finally:
        eng.close()


def test_an_integer_average_is_refused_on_gloo_only() -> None:
    """gloo (CPU tensors) fails an integer AVG after the exchange, so it is refused before; NCCL
    averages integers (``ncclAvg``), so a tensor of another device is left to it (before: refused on
    every backend). A bool AVG and an integer PREMUL_SUM stay refused everywhere (NCCL refuses them too)."""
    from zeropp.comm.backend import check_op_dtype

    with pytest.raises(ValueError, match=r"ReduceOp.AVG of a torch.int64 tensor: .*gloo, the backend of CPU tensors"):
        check_op_dtype("avg", torch.arange(4), "all-reduce")
    elsewhere = torch.empty(4, dtype=torch.int64, device="meta")  # stands for a CUDA tensor (NCCL) here
    check_op_dtype("avg", elsewhere, "all-reduce")
    check_op_dtype("avg", torch.zeros(4), "all-reduce")
    with pytest.raises(ValueError, match=r"ReduceOp.AVG of a torch.bool tensor: its mean is not a torch.bool;"):
        check_op_dtype("avg", elsewhere.bool(), "all-reduce")
    with pytest.raises(ValueError, match=r"ReduceOp.PREMUL_SUM of a torch.int64 tensor"):
        check_op_dtype("premul_sum", elsewhere, "reduce-scatter")


def test_the_stand_in_gradients_cost_nothing_and_a_bad_call_timeout_is_refused() -> None:
    """Between steps each ``p.grad`` is a ``GradInEngine`` (no storage): the memory report counts no
    gradient bytes for it (it would count a full gradient per parameter by shape), and ``close()``
    leaves a plain model. ``call_timeout`` must be a positive ``timedelta``."""
    import datetime

    from zeropp.runtime.wrapped import GradInEngine

    with fake_world(0, 2):
        eng = _engine(mlp(), 1)
        try:
            assert all(isinstance(p.grad, GradInEngine) for p in eng.model.parameters())
            assert eng.memory_report()["grads"] == 0
        finally:
            eng.close()
        assert all(p.grad is None for p in eng.model.parameters())
        for bad in (datetime.timedelta(0), 60):
            with pytest.raises(
                ValueError, match=r"wait for every rank to call them, must be a positive datetime.timedelta, got "
            ):
                ZeroEngine(mlp(), config=ZeroConfig(stage=1), call_timeout=bad)  # type: ignore[arg-type]


def test_a_copy_of_the_wrapped_model_is_a_plain_model() -> None:
    """The conversion refusal and the stand-in gradients hold for the wrapped model only: a deep copy
    (an EMA model) or a pickled copy converts and drops its gradients as a plain model does (the
    refusal's own methods ride along on the copy's modules, and a pickled one finds its class's back)."""
    import copy
    import pickle

    with fake_world(0, 2):
        eng = _engine(mlp(), 1)
        try:
            with pytest.raises(RuntimeError, match=r"converting or moving the wrapped model .* ZeroConfig\(precision="):
                eng.model.half()
            for twin in (copy.deepcopy(eng.model), pickle.loads(pickle.dumps(eng.model))):
                twin.zero_grad()
                assert [p.grad for p in twin.parameters()] == [None] * len(list(twin.parameters()))
                assert {p.dtype for p in twin.half().parameters()} == {torch.float16}
            assert {p.dtype for p in eng.model.parameters()} == {torch.float32}
        finally:
            eng.close()
