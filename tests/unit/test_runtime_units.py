"""Single-process pieces of the runtime: config validation, partitioning, the sharded AdamW.

Here: the one-process checks of this topic; its other tiers' checks are in
``tests/distributed/test_runtime_units.py``.
"""

import pytest
import torch

from tests.runtime_helpers import TINY, make_model
from zeropp.comm.spec import RECIPES, QuantRecipe, QuantSpec
from zeropp.runtime import OptimizerConfig, ShardedAdamW, ZeroConfig, expected_memory
from zeropp.runtime.config import validate_against_topology
from zeropp.runtime.units import build_units


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stage=4), "stage must be 0, 1, 2 or 3"),
        (dict(precision="fp8"), "precision must be one of"),
        (dict(stage=3, weights=dict(bits=3)), "QuantSpec.bits=3 is not supported"),
        (dict(stage=3, grads=dict(bits=2)), "QuantSpec.bits=2 is not supported"),
        (dict(stage=3, grads=dict(bits=4, intra_bits=6)), "intra_bits=6"),
        (dict(stage=2, hpz=True), "set stage=3 or hpz=False"),
        (dict(stage=1, weights=dict(bits=8)), "set stage=3"),
        # the spec by its label (before: its whole repr, QuantSpec(bits=8, group_size=None, ...))
        (dict(stage=1, weights=dict(scheme="nvfp4", bits=4)), r"^ZeroConfig.weights \(nvfp4, qwZ\) quantizes"),
        (dict(stage=0, grads=dict(bits=4)), r"^ZeroConfig.grads \(int4, qgZ\) .*stage 0 does not use"),
        (dict(stage=0, weight_diff=dict(bits=4)), r"^ZeroConfig.weight_diff \(int4, qWD\) replaces"),
        (dict(stage=3, hpz_size=2), "hpz=False"),
        (dict(stage=3, weights=dict(bits=8, error_feedback=True)), "error_feedback=True.*one hop"),
        (dict(stage=3, weights=dict(bits=8, intra_bits=4)), "intra_bits=4.*one hop"),
        (dict(stage=2, persistence_threshold=10), "only applies at stage 3"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be >= 1"),
        (dict(grad_clip=0.0), "grad_clip must be a finite number > 0"),
        (dict(prefetch_depth=-1), "prefetch_depth must be >= 0"),
        (dict(stage=3, grads=dict(bits=4, group_size=127)), "group_size=127 is odd"),
        (dict(stage=3, weights=dict(bits=8, group_size=0)), "group_size must be a positive int"),
        (dict(stage=3, weights="int8"), "weights must be a zeropp.comm.spec.QuantSpec or None, got str"),
        (dict(stage=3, grads={"bits": 4, "raw": True}), "grads must be a zeropp.comm.spec.QuantSpec or None, got dict"),
        (dict(stage=3, weights=dict(bits=8, rounding="up")), "rounding='up'"),
        (dict(stage=3, grads=dict(bits=4, error_feedback=1)), "error_feedback must be True or False"),
    ],
)
def test_bad_configs_raise_with_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        # a plain dict of QuantSpec fields is built here, inside the check (its own errors count too);
        # the "raw" marker keeps a dict as is, to test ZeroConfig's own type check
        built = {
            k: QuantSpec(**v)
            if k in ("weights", "grads", "weight_diff") and isinstance(v, dict) and "raw" not in v
            else v
            for k, v in kwargs.items()
        }
        ZeroConfig(**built)


def test_from_recipe_takes_weights_grads_and_hpz_from_the_named_recipe():
    c = ZeroConfig.from_recipe("zeropp", stage=3, grad_clip=1.0)
    r = RECIPES["zeropp"]
    assert (c.weights, c.grads, c.hpz, c.grad_clip) == (r.weights, r.grads, True, 1.0)
    assert ZeroConfig.from_recipe("none") == ZeroConfig()
    assert ZeroConfig.from_recipe(QuantRecipe(grads=QuantSpec(bits=8)), stage=1).grads == QuantSpec(bits=8)
    with pytest.raises(ValueError, match="unknown quantization recipe 'int3'"):
        ZeroConfig.from_recipe("int3")
    with pytest.raises(ValueError, match="come from the recipe"):
        ZeroConfig.from_recipe("int8", hpz=True)
    with pytest.raises(ValueError, match="set stage=3"):
        ZeroConfig.from_recipe("int8", stage=2)  # the recipe's values are validated like any others


def test_topology_checks_and_optimizer_config():
    validate_against_topology(ZeroConfig(stage=3, hpz=True), 4, 2, 2)
    with pytest.raises(ValueError, match="does not divide ranks_per_node=4"):
        validate_against_topology(ZeroConfig(stage=3, hpz=True, hpz_size=3), 8, 2, 4)
    with pytest.raises(ValueError, match="does not match the world size 6"):
        validate_against_topology(ZeroConfig(), 6, 2, 2)
    with pytest.raises(ValueError, match="betas"):
        OptimizerConfig(betas=(0.9, 1.0))
    with pytest.raises(TypeError):
        ZeroConfig(3)  # keyword-only


def test_partition_pads_shards_and_round_trips():
    model = make_model()
    names = dict(model.named_parameters())
    units, blocks, root, pers = build_units(
        model, stage=3, world_size=3, rank=1, dtype=torch.float32, persistence_threshold=40
    )
    assert [u.name for _, u in blocks] == ["block0", "block1"] and root is not None and pers is not None
    assert all(p.numel() < 40 for p in pers.params) and all(p.numel() >= 40 for u in units[:-1] for p in u.params)
    covered = [s.name for u in units for s in u.slots]
    assert sorted(covered) == sorted(names)  # every parameter in exactly one unit
    for u in units:
        assert u.padded % u.num_shards == 0 and 0 <= u.padded - u.numel < u.num_shards
        flat = u.flatten_data()
        every_name = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name
        for n, t in u.unflatten(flat).items():
            assert torch.equal(t, every_name[n].data)
        a, b = u.shard_range()
        assert b - a == u.shard_numel and (u.kind == "replicated" or a == u.shard_numel)


@pytest.mark.parametrize("offset", [0, 3], ids=["flat-at-0", "flat-inside-a-larger-buffer"])
def test_bind_points_each_parameter_at_its_slot(offset: int):
    """``bind`` builds each parameter's view with ``as_strided``: the same shape, strides, storage
    offset and memory as slicing and viewing ``flat`` would give, for a scalar, an empty, a 17x257
    and a 7-element parameter, with ``flat`` at the start of its storage or inside a larger buffer;
    a strided ``flat`` (not the gathers' kind) takes the slicing path and binds the same values."""
    from torch import nn

    from zeropp.runtime.partition import FlatUnit

    shapes = [(), (3, 0, 5), (17, 257), (7,)]
    named = [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    u = FlatUnit.build("u", named, kind="sharded", num_shards=2, shard_rank=0, dtype=torch.float32)
    base = torch.arange(offset + u.padded, dtype=torch.float32)
    flat = base[offset:]  # [padded]
    u.bind(flat)
    for s, p in zip(u.slots, u.params):
        want = flat[s.offset : s.offset + s.numel].view(s.shape)
        assert (p.shape, p.stride(), p.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
        assert p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and torch.equal(p.data, want)
    strided = torch.arange(2 * u.padded, dtype=torch.float32)[::2]  # [padded], stride 2
    u.bind(strided)
    for s, p in zip(u.slots, u.params):
        assert torch.equal(p.data, strided[s.offset : s.offset + s.numel].view(s.shape))


@pytest.mark.parametrize("missing", [True, False], ids=["a-missing-grad", "every-grad-one-cat"])
def test_flatten_grads_into_a_used_buffer_zeroes_missing_grads_and_padding(missing: bool):
    """A pool buffer comes back holding the last reduction's values: flatten_grads must leave the
    gradients in their slots and zeros everywhere else (a parameter without gradient, the padding).
    With every gradient present (one ``torch.cat``) a non-contiguous gradient lands in its slot too."""
    model = make_model()
    units, *_ = build_units(model, stage=3, world_size=3, rank=0, dtype=torch.float32, persistence_threshold=0)
    u = next(u for u in units if len(u.params) > 2 and u.padded > u.numel and any(p.dim() == 2 for p in u.params))
    skip = u.params[1] if missing else None  # this one got no gradient
    gen = torch.Generator().manual_seed(0)
    want = torch.cat(
        [torch.zeros(p.numel()) if p is skip else torch.randn(p.numel(), generator=gen) for p in u.params]
        + [torch.zeros(u.padded - u.numel)]
    )
    for out in (torch.full((u.padded,), float("nan")), None):
        for s, p in zip(u.slots, u.params):
            g = want[s.offset : s.offset + s.numel].view(p.shape).clone()
            if p.dim() == 2:
                g = g.t().contiguous().t()  # the same values, column-major: reshape(-1) must copy
                assert not g.is_contiguous()
            p.grad = None if p is skip else g
        got = u.flatten_grads(out=out)
        assert torch.equal(got, want) and all(p.grad is None for p in u.params)


def test_sharded_adamw_matches_torch_adamw_bitwise():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    cfg = OptimizerConfig(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ref = [p.clone().requires_grad_() for p in params]
    topt = torch.optim.AdamW(ref, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
    flat = torch.cat([p.reshape(-1) for p in params])
    # two shards of the flat buffer, updated independently, as two ranks would
    shards = [flat[:10].clone(), flat[10:].clone()]
    opt = ShardedAdamW(shards, cfg)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        topt.step()
        gflat = torch.cat([g.reshape(-1) for g in grads])
        opt.step([gflat[:10].clone(), gflat[10:].clone()])
    got = torch.cat(opt.masters)
    want = torch.cat([p.detach().reshape(-1) for p in ref])
    assert torch.equal(got, want)
    assert opt.nbytes() == 3 * 4 * flat.numel()


def test_expected_memory_is_the_zero_table():
    psi, n = 1000, 4
    rows = {s: expected_memory(s, psi, n)["total"] for s in range(4)}
    assert rows == {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert expected_memory(3, psi, n, hpz_size=2)["hpz_secondary"] == 2 * psi / 2
    assert TINY.num_params() > 0
