"""Checkpoints (exact resume, atomicity, consolidation), evaluation at stage 3, and bad
configurations failing on every rank before any collective, in one 2x2 world."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from tests.runtime_helpers import TINY, make_model, rank_batches, text_batch
from tests.worlds import run_world

STEPS, SPLIT = 6, 3


def _engine(seed, **kw):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed=seed),
        config=ZeroConfig(**{"stage": 3, "grad_accum_steps": 2, "grad_clip": 0.5, **kw}),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=STEPS + 2),
        topology=Topology(nodes=2, ranks_per_node=2),
    )


class HalfWriter(FileSystemWriter):
    """A DCP writer that leaves half a file and dies (a crash mid-write), on whichever rank uses it."""

    def __init__(self, d):
        super().__init__(d, single_file_per_rank=True, thread_count=1)
        self.dir = Path(d)

    def write_data(self, plan, planner):
        (self.dir / f"__{dist.get_rank()}_0.distcp").write_bytes(b"half a checkpoint")
        raise OSError("simulated crash mid-write")


def _train(eng, rank, steps):
    out = []
    for s in steps:
        lr = eng.optim.lr
        res = eng.train_step(rank_batches(s, 2, rank, TINY, text=True))
        assert res.lr == lr == eng.opt_cfg.lr_at(s)  # the schedule continues from the restored step count
        out.append(res.loss)
    return out


def _ckpt_world(rank, world, path):
    from zeropp.runtime import ZeroConfig, ZeroEngine, checkpoint, checkpoint_io

    out = {}
    # 1. uninterrupted reference run
    ref = _engine(0)
    out["ref"] = _train(ref, rank, range(STEPS))
    ref_sd = ref.consolidated_state_dict()
    ref.close()

    # 2. interrupted run: 3 steps, save, one more step, then two saves that crash
    a = _engine(0)
    _train(a, rank, range(SPLIT))
    a.save_checkpoint(path, extra={"step": SPLIT, "data": [rank, "pos"]})
    _train(a, rank, [SPLIT])
    real_commit, real_writer = checkpoint_io._commit, checkpoint_io._storage_writer
    crashes = 0

    def crash_commit(root, tag):
        raise OSError("simulated crash before commit")

    for where in ("commit", "write"):
        checkpoint_io._commit = crash_commit if where == "commit" else real_commit
        checkpoint_io._storage_writer = HalfWriter if where == "write" else real_writer
        try:
            a.save_checkpoint(path)
        except checkpoint.CheckpointError as e:  # raised on every rank, naming the rank(s) that failed
            crashes += 1
            out.setdefault("crash_ranks", []).append(sorted(e.failures))
            out.setdefault("crash_msgs", []).append(str(e))
        finally:
            checkpoint_io._commit, checkpoint_io._storage_writer = real_commit, real_writer
    out["crashes"] = crashes
    a.close()

    # 3. a fresh engine with different initial weights resumes from the last complete checkpoint
    b = _engine(seed=123, hpz=True)  # hpZ too: its secondary copies must not survive the load
    b.model(*text_batch(99, 0, rank))  # a forward with grad builds secondary copies ...
    out["secondary_before_load"] = any(u.secondary is not None for u in b.units)
    out["extra"] = b.load_checkpoint(path)
    out["latest_after_crashes"] = (Path(path) / "LATEST").read_text().strip()
    out["secondary_after_load"] = any(u.secondary is not None for u in b.units)
    b.stage3.release_all()
    out["resumed"] = _train(b, rank, range(SPLIT, STEPS))
    sd = b.consolidated_state_dict()
    out["same_weights"] = all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)

    # 4. consolidated weights load into the plain model; stage-3 eval under no_grad agrees
    idx, tgt = text_batch(1000, 0, 0)  # same batch on every rank
    plain = make_model(seed=7)
    plain.load_state_dict(sd)
    with torch.no_grad():
        out["plain_loss"] = float(plain(idx, tgt)[1])
    out["engine_eval"] = b.eval_loss(idx, tgt)
    out["params_free_after_eval"] = all(p.numel() == 0 for u in b.units for p in u.params)

    dist.barrier()
    out["dirs_before"] = sorted(p.name for p in Path(path).iterdir())
    dist.barrier()
    b.save_checkpoint(path)  # keeps the 2 newest of its chain: the version it resumed from and this one
    out["dirs_after"] = sorted(p.name for p in Path(path).iterdir())

    # 5. a checkpoint of another stage loads (DCP reshards); one of another partitioning is refused
    c = _engine(0, stage=2)
    c.load_checkpoint(path)
    out["stage2_from_stage3"] = _train(c, rank, range(STEPS, STEPS + 2))
    c.close()
    out["stage3_continued"] = _train(b, rank, range(STEPS, STEPS + 2))
    c = _engine(0, persistence_threshold=100)  # small parameters move into a 'persistent' unit
    try:
        c.load_checkpoint(path)
        out["layout_mismatch"] = None
    except checkpoint.CheckpointError as e:  # every rank raises, with the reason
        out["layout_mismatch"] = str(e)
    c.close()
    b.close()

    # 6. exact resume through the other parameter paths: replicated (stage 0), all-gathered (stage 1)
    out["resume_other_stages"] = {}
    for stage in (0, 1, 2):
        ref = _engine(0, stage=stage)
        want = _train(ref, rank, range(4))
        ref.close()
        a = _engine(0, stage=stage)
        _train(a, rank, range(2))
        a.save_checkpoint(f"{path}-s{stage}")
        a.close()
        b2 = _engine(5, stage=stage)
        b2.load_checkpoint(f"{path}-s{stage}")
        out["resume_other_stages"][stage] = (_train(b2, rank, range(2, 4)), want[2:])
        b2.close()

    # 7. bad configurations raise on every rank before any collective, leaving the world usable
    from zeropp.comm import Topology
    from zeropp.comm.spec import QuantSpec

    errors = []
    for kwargs in (
        lambda: dict(stage=3, hpz=True, hpz_size=3),
        lambda: dict(stage=2, hpz=True),
        lambda: dict(stage=3, weights=QuantSpec(bits=5)),
    ):
        try:
            _engine(0, **kwargs())
        except ValueError as e:
            errors.append(str(e))

    try:
        ZeroEngine(make_model(), config=ZeroConfig(stage=3), topology=Topology(nodes=3, ranks_per_node=2))
    except ValueError as e:
        errors.append(str(e))
    dist.barrier()
    out["errors"] = errors
    return out


def test_resume_atomicity_consolidation_eval_and_bad_configs(tmp_path):
    res = run_world(_ckpt_world, 4, str(tmp_path / "ckpt"), timeout=120)
    r = res[0]
    for rr in res:  # every rank raised, naming rank 0 (only it commits), then all ranks (all writes crashed)
        assert rr["crashes"] == 2 and rr["crash_ranks"] == [[0], [0, 1, 2, 3]], rr["crash_ranks"]
        assert "simulated crash before commit" in rr["crash_msgs"][0] and "mid-write" in rr["crash_msgs"][1]
        assert rr["extra"] == {"step": SPLIT, "data": [0, "pos"]}  # rank 0's values: extra is saved once
    # resuming reproduces the uninterrupted run exactly (fp32), despite the two crashed saves
    assert r["resumed"] == r["ref"][SPLIT:], (r["resumed"], r["ref"])
    assert r["same_weights"]
    for stage, (got, want) in r["resume_other_stages"].items():
        assert got == want, (stage, got, want)
    assert r["secondary_before_load"] and not r["secondary_after_load"]
    # the consolidated state_dict is the plain model's; evaluation at stage 3 gives its loss
    assert abs(r["engine_eval"] - r["plain_loss"]) <= 1e-6 * r["plain_loss"]
    assert r["params_free_after_eval"]
    # stage 3's checkpoint continues at stage 2 like stage 3 itself continues (fp32 tolerance)
    for a_, b_ in zip(r["stage2_from_stage3"], r["stage3_continued"]):
        assert abs(a_ - b_) <= 1e-5 * abs(b_), (r["stage2_from_stage3"], r["stage3_continued"])
    lm = r["layout_mismatch"]
    assert lm is not None and "partitioning differs" in lm and "persistent" in lm, lm
    msgs = r["errors"]
    assert len(msgs) == 4
    assert "divisor of ranks_per_node" in msgs[0] or "does not divide" in msgs[0]
    assert "set stage=3 or hpz=False" in msgs[1]
    assert "bits=5 is not supported" in msgs[2]
    assert "process group has 4" in msgs[3] or "world size 4" in msgs[3]
    assert r["latest_after_crashes"].startswith(f"ckpt-{SPLIT:08d}-")  # the crashed saves left it alone
    assert r["dirs_before"] == ["LATEST", r["latest_after_crashes"]]  # both crashed saves removed their folders
    newest = (tmp_path / "ckpt" / "LATEST").read_text().strip()
    assert r["dirs_after"] == sorted(["LATEST", r["latest_after_crashes"], newest])
    assert newest.startswith(f"ckpt-{STEPS:08d}-")
