"""A resumed run with error feedback and stochastic rounding is the uninterrupted run, bit for bit.

2x2 gloo world, stage 3 (INT4 weights + INT4 gradients, both stochastic, error feedback on both
qgZ hops with 8-bit residuals: ``w4g4`` + EF + SR) and stage 2 (INT4 stochastic gradients + EF):
N steps straight vs k steps, save, a fresh engine built from *other* weights whose stochastic
call counter (its communication session's) moved on, load, N - k steps. Losses, weights, residuals and the counter
must be identical. Two controls show the test would see a difference: resuming without the
residuals, or with another counter, changes the losses. A load at another world size drops the
residuals with a warning (they are laid out per rank) and keeps training.
"""

from __future__ import annotations

import warnings

import torch

from tests.runtime_helpers import TINY, make_model, rank_batches
from tests.worlds import run_world

N, K = 5, 2


def _config(stage: int):
    from zeropp.comm.spec import QuantSpec
    from zeropp.runtime import ZeroConfig

    grads = QuantSpec(bits=4, rounding="stochastic", seed=7, error_feedback=True)
    weights = QuantSpec(bits=4, rounding="stochastic", seed=7) if stage == 3 else None
    return ZeroConfig(stage=stage, weights=weights, grads=grads, grad_accum_steps=2)


def _engine(stage: int, seed: int, nodes: int = 2, rpn: int = 2):
    from zeropp.comm import Topology
    from zeropp.runtime import OptimizerConfig, ZeroEngine

    return ZeroEngine(
        make_model(seed=seed),
        config=_config(stage),
        optimizer=OptimizerConfig(lr=1e-2),
        topology=Topology(nodes=nodes, ranks_per_node=rpn),
    )


def _train(eng, rank: int, steps) -> list[float]:
    return [eng.train_step(rank_batches(s, 2, rank, TINY, text=True)).loss for s in steps]


def _state(eng) -> dict:
    """Weights and residuals as numpy (a tensor would be shared by fd across the result queue)."""
    return {
        "weights": {k: v.numpy() for k, v in eng.consolidated_state_dict().items()},
        "feedback": {k: v.clone().numpy() for k, v in eng.error_feedback.state_dict().items()},
        "calls": eng.comm_session.stochastic.value,
    }


def _same(a: dict, b: dict) -> bool:
    import numpy as np

    return (
        a["calls"] == b["calls"]
        and a["weights"].keys() == b["weights"].keys()
        and all(np.array_equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        and a["feedback"].keys() == b["feedback"].keys()
        and all(np.array_equal(a["feedback"][k], b["feedback"][k]) for k in a["feedback"])
    )


def _resume_world(rank: int, world: int, path: str) -> dict:
    out: dict = {}
    for stage in (3, 2):
        ckpt = f"{path}-s{stage}"
        ref = _engine(stage, 0)
        ref_losses = _train(ref, rank, range(N))
        ref_state = _state(ref)
        ref.close()

        a = _engine(stage, 0)
        first = _train(a, rank, range(K))
        hop2 = [k for k in a.error_feedback.keys() if k.endswith("@hop2")]  # noqa: SIM118 (not a mapping)
        a.save_checkpoint(ckpt)
        a.close()

        b = _engine(stage, 5)  # other weights: everything must come from the checkpoint
        b.comm_session.stochastic.reset(12345)  # and a counter that moved on
        b.load_checkpoint(ckpt)
        resumed = first + _train(b, rank, range(K, N))
        same = _same(_state(b), ref_state)
        b.close()

        controls = {}
        for what in ("no_residuals", "other_counter"):
            c = _engine(stage, 5)
            c.load_checkpoint(ckpt)
            if what == "no_residuals":
                c.error_feedback.reset()
            else:
                c.comm_session.stochastic.reset(c.comm_session.stochastic.value + 1)
            controls[what] = first + _train(c, rank, range(K, N))
            c.close()
        fields = sorted({k.rpartition("|")[2] for k in ref_state["feedback"]})
        out[stage] = dict(ref=ref_losses, resumed=resumed, same_state=same, controls=controls, hop2=hop2, fields=fields)
    return out


def _reshard_world(rank: int, world: int, path: str) -> dict:
    """Load the 2x2 stage-3 checkpoint on 2 ranks: residuals dropped (warned), counter restored."""
    eng = _engine(3, 5, nodes=1, rpn=2)
    eng.comm_session.stochastic.reset(999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng.load_checkpoint(f"{path}-s3")
    out = {
        "warnings": [str(w.message) for w in caught if "error-feedback" in str(w.message)],
        "keys_after_load": eng.error_feedback.keys(),
        "calls": eng.comm_session.stochastic.value,
    }
    out["losses"] = _train(eng, rank, range(K, N))
    eng.close()
    return out


def test_resume_with_error_feedback_and_stochastic_rounding_is_exact(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    res = run_world(_resume_world, 4, path, timeout=300)
    for rank, r in enumerate(res):
        for stage in (3, 2):
            s = r[stage]
            assert s["hop2"], (rank, stage)  # hierarchical qgZ: residuals of the second hop exist and are saved
            assert s["resumed"] == s["ref"], (rank, stage, s["resumed"], s["ref"])  # bit-identical losses
            assert s["same_state"], (rank, stage)  # weights, residuals (both hops) and the counter
            assert s["fields"] == ["codes", "layout", "scales"], s["fields"]  # kept (and saved) in 8 bits
            for what, losses in s["controls"].items():
                assert losses != s["ref"], (rank, stage, what)  # the test can see a missing piece
    other = run_world(_reshard_world, 2, path, timeout=300)
    assert any("dropping the error-feedback residuals" in m for m in other[0]["warnings"]), other[0]["warnings"]
    for r in other:
        assert r["keys_after_load"] == []
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    # the 4 saving ranks shared one counter, so the 2 loading ranks continue from it
    assert other[0]["calls"] == other[1]["calls"] != 999
