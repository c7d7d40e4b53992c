"""Buffer lifetimes across streams (``zeropp/comm/lifetime.py``) and the debug mode that shows
an early release on CPU (``ZEROPP_DEBUG_STREAMS=1``).

The fault: a communication buffer released (or handed back to a pool) while a collective or a
continuation on another stream still reads or writes it is silently overwritten by the next
allocation. On CPU nothing is really reused, so the debug mode poisons released buffers, keeps
poisoning them at every completion point while they are alive, and runs continuations late.
The checks, cheapest first:

- the pieces alone (one process): the poison values, what :class:`Buffers` poisons and what it
  never touches, the pool's LIFO reuse and poisoning, a handle's release order, the late start
  of continuations (and its bound), and the mode's teeth on one continuation: the same code with
  the buffer released at issue reads NaN;
- on a 2-node x 2-rank gloo world with the variable set by the launcher (``tests/streams_helpers.py``,
  run inside ``test_comm_overlap``'s 2x2 world, so it costs no launch of its own): outstanding and
  chunked hierarchical qgZ, the DDP hook and a stage-3 ZeRO++ engine step give the results of the
  run without the mode; with qgZ's hop-1 rows released at issue, or the engine's reduce-scatter
  output handed back to the pool before its wait, the same runs give wrong results.

Here: the end-to-end checks of this topic; its other tiers' checks are in ``tests/unit/test_comm_streams.py``.
"""

from __future__ import annotations

from zeropp.comm import context


def test_the_runner_refuses_a_bad_value_before_any_rank_starts(tmp_path) -> None:
    from tests.experiment_helpers import run_cli

    p = run_cli(
        [
            "quant=qgz",
            "model=tiny",
            "train.steps=1",
            "logger=none",
            "launcher.progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        env={context.DEBUG_ENV: "yes"},
        timeout=120,
    )
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "error: invalid environment: ZEROPP_DEBUG_STREAMS='yes' is not a valid setting" in p.stdout + p.stderr
    assert not (tmp_path / "run" / "ranks").exists()  # nothing started
