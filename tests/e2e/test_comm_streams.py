"""Buffer lifetimes across streams (``zeropp/comm/lifetime.py``) and the debug mode that shows an early
release on CPU (``ZEROPP_DEBUG_STREAMS=1``).

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_comm_streams.py``.
"""

from __future__ import annotations

from zeropp.comm import context


def test_the_runner_refuses_a_bad_value_before_any_rank_starts(tmp_path, capfd) -> None:
    from tests.experiment_helpers import run_cli_here

    p = run_cli_here(
        [
            "quant=qgz",
            "model=tiny",
            "train.steps=1",
            "logger=none",
            "launcher.progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capfd,
        env={context.DEBUG_ENV: "yes"},
        timeout=120,
    )
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "error: invalid environment: ZEROPP_DEBUG_STREAMS='yes' is not a valid setting" in p.stdout + p.stderr
    assert not (tmp_path / "run" / "ranks").exists()  # nothing started
