"""The shared-memory transport (``zeropp.comm.shm``): the same results as the reference sums and
gathers on awkward sizes and every float dtype, chunked through a small region, a reduce-scatter
bit for bit the backend's; an engine trained through it equal to one trained through gloo; setup
faults raised on every rank; nothing left under the region's directory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.parity_helpers import BASE, STEPS, check_parity
from tests.runtime_helpers import parity_world, tiny_tmpfs
from tests.worlds import run_world
from zeropp.comm import shm_sync

pytestmark = pytest.mark.distributed

SIZES = [1, 7, 17 * 257]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(n, generator=g).mul(3).to(dtype)


def _collectives(rank: int, world: int, region_bytes: int, flags: bool) -> list[tuple[str, bool]]:
    """Every (size, dtype): the transport's results against sums of all ranks' inputs made here.
    ``flags``: synchronised by the futex counters (where the machine allows), else by the backend."""
    import torch.distributed as dist

    from zeropp.comm import collectives, shm_sync
    from zeropp.comm import shm as shm_module

    if not flags:
        shm_module.flags_usable = lambda: False  # this rank process only
    shm = shm_module.ShmTransport(region_bytes=region_bytes)
    want_sync = shm_sync.FlagSync if flags and shm_sync.flags_usable() else shm_sync.BackendSync
    out = [("synchronisation", type(shm._sync) is want_sync)]
    for n in SIZES:
        for dtype in DTYPES:
            tag = f"{n}/{dtype}"
            everyone = [_inputs(r, n * world, dtype, n) for r in range(world)]  # [W] of [W * n]
            # all-gather: rank r's shard is its first n values
            gathered = torch.full((world * n,), float("nan"), dtype=dtype)
            shm.all_gather(gathered, everyone[rank][:n]).wait()
            out.append((f"gather {tag}", torch.equal(gathered, torch.cat([e[:n] for e in everyone]))))
            # reduce-scatter: the rank-order sum of chunk `rank` of everyone's input
            mine = torch.empty(n, dtype=dtype)
            shm.reduce_scatter_sum(mine, everyone[rank]).wait()
            rows = torch.stack([e.view(world, n)[rank] for e in everyone])  # [W, n]
            want = collectives.rank_order_sum(rows, torch.empty(n, dtype=dtype))
            out.append((f"scatter {tag}", torch.equal(mine, want)))
            # all-reduce, in place, on a non-contiguous view (written back)
            base = everyone[rank].clone().view(world, n)
            t = base[:, :1] if n > 1 else base  # [W, 1] strided
            want_all = collectives.rank_order_sum(
                torch.stack([e.view(world, n)[:, :1].reshape(-1) if n > 1 else e for e in everyone]),
                torch.empty(t.numel(), dtype=dtype),
            )
            shm.all_reduce_sum(t).wait()
            out.append((f"all-reduce {tag}", torch.equal(t.reshape(-1), want_all)))
    # several collectives in flight before any wait: each still gets its own values
    a, b = torch.empty(world * 5), torch.empty(3)
    first = shm.all_gather(a, torch.full((5,), float(rank)))
    second = shm.reduce_scatter_sum(b, torch.arange(world * 3, dtype=torch.float32) + rank)
    second.wait()
    first.wait()
    out.append(("in flight gather", torch.equal(a, torch.arange(world).repeat_interleave(5).float())))
    want_b = sum(torch.arange(world * 3, dtype=torch.float32).view(world, 3)[rank] + r for r in range(world))
    out.append(("in flight scatter", torch.equal(b, want_b)))
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "region_bytes, flags",
    [(8 * 4 * 1024, True), (32 << 20, True), (8 * 4 * 1024, False)],
    ids=["chunked", "whole", "backend-sync"],
)
def test_collectives_match_reference_sums(region_bytes, flags):
    for rank_results in run_world(_collectives, 4, region_bytes, flags, timeout=180):
        bad = [name for name, ok in rank_results if not ok]
        assert not bad, bad


def _sub_group_gathers(rank: int, world: int) -> list[str]:
    """Gathers inside pairs of members through a region of 4 KiB rows (several uses each), against
    the pair's shards; then the refusals: ``within`` without this rank, and pairs against a whole
    gather issued at the same point."""
    from zeropp.comm.shm import ShmError, ShmTransport

    shm = ShmTransport(region_bytes=8 * 4 * 1024)
    pair = range(rank // 2 * 2, rank // 2 * 2 + 2)
    out = []
    for n in SIZES:
        shards = [_inputs(r, n, torch.float32, n) for r in range(world)]
        got = torch.full((2 * n,), float("nan"))
        shm.all_gather(got, shards[rank], pair).wait()
        if not torch.equal(got, torch.cat([shards[r] for r in pair])):
            out.append(f"pair gather of {n} differs")
    try:
        shm.all_gather(torch.empty(2), torch.ones(1), range((rank + 2) % world, (rank + 2) % world + 1))
    except ValueError as e:
        out.append(str(e))
    try:  # ranks 0-1 gather in their pair, ranks 2-3 the whole group: both sides raise
        whole = rank >= 2
        shm.all_gather(torch.empty(world if whole else 2), torch.ones(1), None if whole else pair).wait()
    except ShmError as e:
        out.append(str(e))
    return out


def test_gathers_inside_sub_groups_read_their_own_rows():
    for errors in run_world(_sub_group_gathers, 4):
        assert len(errors) == 2, errors
        assert "must be consecutive member indices" in errors[0] and "include this rank" in errors[0], errors
        assert "same collectives" in errors[1], errors


def _setup_fails(rank: int, world: int, directory: str, region_bytes: int | None = None) -> str:
    from zeropp.comm.shm import ShmError, ShmTransport

    try:
        ShmTransport(directory=directory, region_bytes=region_bytes)
    except ShmError as e:
        return str(e)
    return "no error"


def test_unusable_directory_is_one_error_on_every_rank(tmp_path):
    missing = str(tmp_path / "nowhere")
    errors = run_world(_setup_fails, 3, missing)
    assert all("zero.transport=shm" in e and "use zero.transport=backend" in e for e in errors), errors
    assert "could not create" in errors[0] and missing in errors[0], errors[0]


def _leftovers(rank: int, world: int, directory: str) -> list[str]:
    from zeropp.comm.shm import ShmTransport

    shm = ShmTransport(directory=directory, region_bytes=1 << 20)
    t = torch.ones(10)
    shm.all_reduce_sum(t).wait()
    assert torch.equal(t, torch.full((10,), float(world)))
    return sorted(os.listdir(directory))


def test_a_shared_memory_too_small_for_the_region_is_one_error_not_a_sigbus(tmp_path):
    """The region is allocated whole at set-up: a tmpfs without room fails there, on every rank,
    instead of killing a rank with SIGBUS at its first write to a page the tmpfs cannot back."""
    with tiny_tmpfs(tmp_path, "256k") as small:
        errors = run_world(_setup_fails, 2, str(small), 1 << 20)
    assert all("No space left on device" in e and "zero.transport=shm" in e for e in errors), errors


def _mismatched(rank: int, world: int, flags: bool) -> list[str]:
    """Rank 0 gathers then reduce-scatters; rank 1 the other way round (and then the reverse sizes)."""
    from zeropp.comm import shm as shm_module
    from zeropp.comm.shm import ShmError, ShmTransport

    if not flags:
        shm_module.flags_usable = lambda: False
    shm = ShmTransport(region_bytes=1 << 20)
    errors = []
    gathered, mine = torch.empty(8), torch.empty(4)
    first = (
        shm.all_gather(gathered, torch.full((4,), float(rank)))
        if rank == 0
        else shm.reduce_scatter_sum(mine, torch.ones(8))
    )
    try:
        shm.all_reduce_sum(torch.ones(3))  # completes the first use: the mismatch is found there
    except ShmError as e:
        errors.append(str(e))
    try:
        first.wait()  # the first collective never finished: its wait says so instead of returning garbage
    except ShmError as e:
        errors.append(str(e))
    out = torch.zeros(4)[::2]  # [2], strided
    try:
        shm.reduce_scatter_sum(out, torch.ones(4))
    except ValueError as e:
        errors.append(str(e))
    return errors


@pytest.mark.parametrize("flags", [True, False], ids=["futex", "backend-sync"])
def test_ranks_issuing_different_collectives_raise_instead_of_reading_unrelated_rows(flags):
    for errors in run_world(_mismatched, 2, flags):
        assert len(errors) == 3, errors
        assert "issued" in errors[0] and "same collectives, with the same sizes and dtypes" in errors[0], errors
        assert "did not finish" in errors[1], errors
        assert "output must be contiguous" in errors[2], errors


def test_region_file_is_gone_once_mapped(tmp_path):
    (tmp_path / "theirs").write_text("not ours")
    listings = run_world(_leftovers, 2, str(tmp_path))
    assert listings == [["theirs"], ["theirs"]]


# Stages 2 and 3 reduce-scatter in rank order through either transport: the same bits as gloo. Stages
# 0-1 (and stage 3's replicated small parameters) all-reduce: rank order here, gloo's ring there.
SHM = [
    dict(BASE, stage=3, transport="shm"),
    dict(BASE, stage=3, transport="shm", coalesce_numel=10**9, keep_at_turn=True, reduce_bucket_size=1000),
    dict(BASE, stage=2, transport="shm"),
    dict(BASE, stage=0, transport="shm"),
    dict(BASE, stage=1, transport="shm", allgather_bucket_size=999),
    dict(BASE, stage=3, transport="shm", persistence_threshold=100),
]
TWINS = [dict(c, transport="backend") for c in SHM[:3]]


def test_engine_through_shared_memory_matches_single_process_and_gloo():
    configs = SHM + TWINS
    results = run_world(parity_world, 4, 1, configs, STEPS, timeout=300)
    check_parity(results, 4, configs[: len(SHM)])
    for shm, twin in zip(SHM, TWINS):
        a, b = results[0][configs.index(shm)], results[0][configs.index(twin)]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"], shm
        assert all(np.array_equal(a["weights"][k], b["weights"][k]) for k in b["weights"]), shm
        assert a["comm"] == b["comm"] and a["calls"] == b["calls"], shm  # accounted as the backend call


HALF_STEPS = 4
HALF = [dict(BASE, stage=s, precision=p) for p in ("bf16", "fp16") for s in (2, 3)]
"""bf16 and fp16 (the parameters, gradients and collectives in that dtype; fp16 with dynamic loss
scaling) at stages 2 and 3, each trained through the shared memory and through gloo."""


def _same_run(a: dict, b: dict) -> list[str]:
    """What differs between two engines' records (losses, norms, loss scales, skipped steps,
    consolidated weights, bytes and calls): nothing, when the runs are bit for bit the same."""
    diff = [k for k in ("losses", "norms", "scales", "skipped", "comm", "calls") if a[k] != b[k]]
    return diff + [k for k in b["weights"] if not np.array_equal(a["weights"][k], b["weights"][k])]


def test_engine_in_half_precision_through_shared_memory_equals_gloo():
    """Half-precision reductions add in rank order with fp32 accumulation and one rounding through
    either transport (``rank_order_sum``; zeropp's gloo reduce-scatter is an all-to-all plus that
    sum, never gloo's own half-precision sum), and a gather is a copy: stages 2 and 3 in bf16 and
    fp16 give the backend's bits, with the same byte accounting."""
    configs = [dict(c, transport=t) for c in HALF for t in ("shm", "backend")]
    (results,) = run_world(parity_world, 4, 1, configs, HALF_STEPS, timeout=300)[:1]
    for i in range(0, len(configs), 2):
        shm, backend = results[i], results[i + 1]
        assert all(np.isfinite(shm["losses"])), configs[i]
        assert not _same_run(shm, backend), (configs[i], _same_run(shm, backend))


HPZ = [
    dict(BASE, stage=3, hpz=True, hpz_size=2),
    dict(BASE, stage=3, hpz=True, hpz_size=2, precision="bf16", allgather_bucket_size=999),
    dict(BASE, stage=3, hpz=True),  # the secondary group is the whole ZeRO group
]
"""Stage 3 with hpZ on one host of 4 ranks (a shared-memory ZeRO group spans one host, so its
secondary groups are inside it): groups of 2 in fp32 and in bf16 with bucketed gathers, and of 4."""


def _hpz_world(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """``parity_world`` on one node, with each engine's full-precision calls of the public
    all-gather counted (the backend's; the shared memory's gathers do not call it)."""
    import zeropp.comm as zcomm
    from tests.runtime_helpers import train_engine

    real, plain = zcomm.quantized_all_gather, []

    def counted(*args, **kwargs):
        plain.append(kwargs.get("spec") is None)
        return real(*args, **kwargs)

    zcomm.quantized_all_gather = counted  # this rank process only
    out = []
    for kw in configs:
        plain.clear()
        r = train_engine(rank, world, kw, steps=HALF_STEPS, nodes=1)
        out.append(dict(r, backend_gathers=sum(plain)) if rank == 0 else {"losses": r["losses"]})
    return out


def test_hpz_secondary_gathers_go_through_shared_memory_with_the_backends_bits():
    """hpZ's backward gathers inside the secondary group use the ZeRO group's region (every rank
    gathers the same unit at the same point, each reading its own group's rows): no backend gather
    is left, and training, bytes and calls are the backend's bit for bit."""
    configs = [dict(c, transport=t) for c in HPZ for t in ("shm", "backend")]
    results = run_world(_hpz_world, 4, configs, timeout=300)[0]
    for i in range(0, len(configs), 2):
        shm, backend = results[i], results[i + 1]
        assert shm["backend_gathers"] == 0 < backend["backend_gathers"], configs[i]
        assert not _same_run(shm, backend), (configs[i], _same_run(shm, backend))


def _half_all_reduces(rank: int, world: int) -> dict[str, tuple[int, float, float]]:
    """Per half dtype: how many elements of a gloo all-reduce differ from the shared memory's, the
    largest difference and the bound on it, both relative to the sum of the magnitudes."""
    import torch.distributed as dist

    from zeropp.comm.shm import ShmTransport

    shm = ShmTransport(region_bytes=1 << 20)
    out = {}
    for dtype, u in ((torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):  # unit roundoffs
        everyone = [_inputs(r, 17 * 257, dtype, 5) for r in range(world)]  # |x| < ~15: no overflow
        backend, mine = everyone[rank].clone(), everyone[rank].clone()
        dist.all_reduce(backend)
        shm.all_reduce_sum(mine).wait()
        magnitude = torch.stack([e.double().abs() for e in everyone]).sum(0)  # sum of |x_r|
        gamma = lambda k, v: k * v / (1 - k * v)  # noqa: E731  (Higham's gamma_k)
        # gloo: W - 1 additions, each rounded to the dtype; shm: W - 1 in fp32, then one rounding
        bound = gamma(world - 1, u) + gamma(world - 1, 2.0**-24) * (1 + u) + u
        diff = ((backend.double() - mine.double()).abs() / magnitude.clamp_min(1e-30)).max().item()
        out[str(dtype)] = (int((backend != mine).sum()), diff, bound)
    return out


def test_half_precision_all_reduce_differs_from_gloos_within_the_rounding_bound():
    """gloo's all-reduce adds half-precision values in the dtype itself, rounding each partial sum,
    in its ring's order; the transport accumulates in fp32 and rounds once (``rank_order_sum``). So
    an all-reduce (stages 0-1, replicated parameters) may differ in the last bits by design, within
    gamma_(W-1)(u) + gamma_(W-1)(2^-24)(1 + u) + u of the sum of magnitudes (docs/collectives.md),
    and nowhere near a wrong sum. (Stages 2-3 reduce-scatter: identical bits, tested above.)"""
    for rank_results in run_world(_half_all_reduces, 4):
        for dtype, (differing, diff, bound) in rank_results.items():
            assert differing > 0, dtype  # the orders differ: else this test would compare nothing
            assert diff <= bound, (dtype, diff, bound)


def test_tensor_parallel_zero_groups_each_get_their_own_region():
    """1 node x 4 ranks, tp=2: two ZeRO groups of 2 (one per tensor-parallel index), each with its
    region; training equals single-process training on the dp ranks' batches."""
    from tests.distributed.test_runtime_tp import BASE as TP_BASE
    from tests.distributed.test_runtime_tp import _check, _tp_world, reference

    configs = [dict(TP_BASE, stage=s, transport="shm") for s in (0, 3)]
    _check(run_world(_tp_world, 4, 1, configs, "gpt", timeout=300), configs, reference("gpt", 2))


def _engine_timeout(rank: int, world: int) -> float:
    import datetime

    from tests.runtime_helpers import make_model
    from zeropp.runtime import ZeroConfig, ZeroEngine

    eng = ZeroEngine(make_model(), config=ZeroConfig(transport="shm"), comm_timeout=datetime.timedelta(seconds=7))  # type: ignore[arg-type]
    try:
        return eng.comm.shm._sync._timeout_s  # type: ignore[union-attr]
    finally:
        eng.close()


@pytest.mark.skipif(
    not shm_sync.flags_usable(), reason="the futex counters (which time out themselves) are x86-64 Linux"
)
def test_the_engine_waits_for_peers_as_long_as_it_is_told():
    """``ZeroEngine(comm_timeout=...)`` (the runner passes ``launcher.pg_timeout_s``) bounds the
    transport's waits for a live peer, not torch's 30-minute default."""
    assert run_world(_engine_timeout, 2) == [7.0, 7.0]


AUTO_CASES = ("default", "no_directory", "no_mapping", "two_nodes")
"""``transport=auto`` on one host of 3 CPU ranks: as it is; with rank 1's ``/dev/shm`` unusable; with
the region's set-up failing on rank 1 only (it cannot open rank 0's file); on 2 nodes."""


def _auto_choices(rank: int, world: int) -> dict[str, dict]:
    """Per case: the engine's resolved transport on this rank and its stage-3 losses (the same bits
    through either transport: a fallback that trained wrongly or hung would show)."""
    from tests.runtime_helpers import train_engine
    from zeropp.comm import shm as shm_module

    out = {}
    for case in AUTO_CASES:
        saved = shm_module.SHM_DIR, shm_module._open_checked
        if rank == 1 and case == "no_directory":
            shm_module.SHM_DIR = "/nonexistent/zeropp"  # read at the call
        if rank == 1 and case == "no_mapping":
            shm_module._open_checked = lambda path, nbytes: (-1, f"rank 1 could not open {path}: refused")
        try:
            nodes = world if case == "two_nodes" else 1
            r = train_engine(rank, world, dict(BASE, stage=3), steps=2, nodes=nodes, consolidate=False)
        finally:
            shm_module.SHM_DIR, shm_module._open_checked = saved
        out[case] = {"transport": r["transport"], "losses": r["losses"]}
    return out


def test_auto_transport_resolves_alike_on_every_rank():
    """``transport=auto`` (the default) takes the shared memory where every rank can, and the backend
    on every rank together where one rank cannot (its ``/dev/shm`` unusable, or the region's set-up
    failing there): never half the ranks on each transport, which would hang. Each engine says what
    it resolved to and why, and trains the same losses either way."""
    ranks = run_world(_auto_choices, 3, timeout=180)
    for case in AUTO_CASES:
        seen = {r[case]["transport"] for r in ranks}
        assert len(seen) == 1, (case, seen)  # the same resolution, and the same reason, on every rank
        assert ranks[0][case]["losses"] == ranks[0]["default"]["losses"], case
    want = {
        "default": "transport=auto -> shm (3 CPU ranks on one host with room for the region)",
        "no_directory": "transport=auto -> backend (rank 1 cannot write to its shared-memory directory)",
        "no_mapping": "transport=auto -> backend (the shared-memory region could not be set up: rank 1 could not open",
        "two_nodes": "transport=auto -> backend (the ZeRO group of rank 0 spans 3 nodes)",
    }
    for case, text in want.items():
        assert ranks[0][case]["transport"].startswith(text), (case, ranks[0][case]["transport"])


def _hpz_secondaries(rank: int, world: int) -> list[bool]:
    """A route over the 4 ranks whose secondary groups are consecutive members on ranks 1 and 3
    (each alone) but not on ranks 0 and 2 (together): whether each rank's route carries its
    secondary gathers."""
    import datetime

    import torch.distributed as dist

    from zeropp.runtime.host_routes import ShmRoute

    groups = {0: dist.new_group([0, 2]), 1: dist.new_group([1]), 3: dist.new_group([3])}  # same order everywhere
    mine = groups[0 if rank in (0, 2) else rank]

    class Owner:  # set-up reads nothing of its owner
        pass

    owner = Owner()
    route = ShmRoute(owner, None, timeout=datetime.timedelta(seconds=30), secondary=mine)  # type: ignore[arg-type]
    return [route.secondary is not None]


def test_hpz_secondary_gathers_take_one_route_on_every_rank():
    """Whether the region carries hpZ's secondary gathers is decided by the whole ZeRO group: a rank
    whose own secondary group could use it keeps the backend when another rank's cannot (else its
    shared-memory gather would wait for ranks gathering through the backend)."""
    assert run_world(_hpz_secondaries, 4) == [[False]] * 4


def _region_mappings() -> int:
    """This process's mappings of a shared-memory region (its file is unlinked once mapped)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "zeropp-shm-" in line)


def _engines_closed_in_turn(rank: int, world: int) -> dict:
    """Three engines built, closed and dropped in turn with the cycle collector off: the mappings
    left after each, and what a collective on a closed engine's transport raises."""
    import gc

    from tests.runtime_helpers import make_model
    from zeropp.comm.shm_sync import ShmError
    from zeropp.runtime import ZeroConfig, ZeroEngine

    gc.collect()
    gc.disable()  # only references may free the region: what a cycle would keep, stays
    try:
        left, error = [], ""
        for _ in range(3):
            eng = ZeroEngine(make_model(), config=ZeroConfig(transport="shm"))  # type: ignore[arg-type]
            mapped = _region_mappings()
            shm = eng.comm.shm
            eng.close()
            eng.close()  # twice: no error
            try:
                shm.all_reduce_sum(torch.ones(4)).wait()  # type: ignore[union-attr]
            except ShmError as exc:
                error = str(exc)
            del eng, shm
            left.append((mapped, _region_mappings()))
        return {"left": left, "error": error}
    finally:
        gc.enable()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads this process's mappings (Linux)")
def test_engine_close_unmaps_the_region_at_once():
    """``engine.close()`` unmaps the ZeRO group's region then and there (not when the cycle
    collector runs), so a later engine in the same process finds ``/dev/shm``'s room again; a
    collective on a closed transport is one clear error."""
    for r in run_world(_engines_closed_in_turn, 2):
        assert r["left"] == [(1, 0)] * 3, r["left"]
        assert "closed" in r["error"], r["error"]


def _tp_choices(rank: int, world: int, directory: str, room_mib: int) -> str:
    """The resolved transport of a tp=2 engine on 1 node x 4 ranks (two ZeRO groups of 2) when the
    shared-memory directory reports ``room_mib`` MiB free."""
    import types

    from tests.runtime_helpers import make_model
    from zeropp.comm import Topology
    from zeropp.comm import shm as shm_module
    from zeropp.runtime import ZeroConfig, ZeroEngine
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    real = os.statvfs

    def statvfs(path: str) -> object:  # the room, as /dev/shm of that size would report it
        if os.path.realpath(path) == os.path.realpath(directory):
            return types.SimpleNamespace(f_bavail=room_mib << 8, f_frsize=4096)
        return real(path)

    shm_module.SHM_DIR, os.statvfs = directory, statvfs  # type: ignore[assignment]
    try:
        topo = Topology(nodes=1, ranks_per_node=world, tp=2)
        eng = ZeroEngine(parallelize(make_model(), make_mesh(topo)), config=ZeroConfig(), topology=topo)
        try:
            return str(eng.transport)
        finally:
            eng.close()
    finally:
        os.statvfs = real  # type: ignore[assignment]


def test_tensor_parallel_zero_groups_resolve_auto_alike(tmp_path):
    """With tp=2 two ZeRO groups each make a region on the host: ``auto`` asks the whole run and
    counts both regions, so a ``/dev/shm`` with room for one region only sends every group to the
    backend together (not one group on each transport, decided by which allocates first), and one
    with room for both gives every group shared memory."""
    for room, want in (
        (48, "transport=auto -> backend (rank 0 has 48 MiB free for shared memory, 2 regions need 64 MiB)"),
        (80, "transport=auto -> shm (4 CPU ranks on one host with room for the region)"),
    ):
        assert run_world(_tp_choices, 4, str(tmp_path), room, timeout=180) == [want] * 4, room


def _tp_explicit_shm_one_group_failing(rank: int, world: int) -> str:
    """A tp=2 engine (two ZeRO groups of 2) with ``transport='shm'`` whose region set-up fails in
    rank 0's ZeRO group only (as a full ``/dev/shm`` seen by that group's members would): what
    each rank got, an error's message or ``"built"``."""
    from tests.runtime_helpers import make_model
    from zeropp.comm import Topology
    from zeropp.comm.shm_sync import ShmError
    from zeropp.comm.stats import group_ranks
    from zeropp.runtime import ZeroConfig, ZeroEngine, host_routes
    from zeropp.runtime.tensor_parallel import make_mesh, parallelize

    real = host_routes.ShmRoute

    def route(owner, group, **kw):  # the agreed failure of one group's set-up, on its members only
        if 0 in group_ranks(group):
            raise ShmError("no room for the region", cause="no room")
        return real(owner, group, **kw)

    host_routes.ShmRoute = route  # type: ignore[assignment,misc]
    try:
        topo = Topology(nodes=1, ranks_per_node=world, tp=2)
        eng = ZeroEngine(parallelize(make_model(), make_mesh(topo)), config=ZeroConfig(transport="shm"), topology=topo)
        eng.close()
        return "built"
    except ShmError as exc:
        return str(exc)
    finally:
        host_routes.ShmRoute = real  # type: ignore[misc]


def test_explicit_shm_with_tensor_parallelism_stops_every_group_when_one_fails():
    """``transport='shm'`` with tp=2: a region that cannot be set up in one ZeRO group stops every
    rank at construction, the other group's naming the failed ranks, instead of that group training
    on into a tensor-parallel collective the failed ranks never join (a hang until the timeout)."""
    got = run_world(_tp_explicit_shm_one_group_failing, 4, timeout=180)
    failed = [r for r, g in enumerate(got) if g == "no room for the region"]
    others = [g for g in got if g != "no room for the region"]
    assert len(failed) == 2 and 0 in failed, got
    assert len(others) == 2 and all(f"another ZeRO group (ranks {failed})" in g for g in others), got
