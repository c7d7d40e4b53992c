"""Every bad input is refused before any rank starts: one ``error: ...`` line naming the key, the value
and what is allowed, exit 2.

Here: the end-to-end checks. The topic's full description and its one-process checks are in
``tests/unit/test_experiments_inputs.py``.
"""

from __future__ import annotations

from pathlib import Path

from tests.cli_helpers import run_cli, unwritable_dir

# ------------------------------------------------------------------ the checkpoint directory


def test_unwritable_run_dir_is_refused_before_hydra_creates_it(tmp_path, monkeypatch, capfd) -> None:
    target = f"{unwritable_dir(tmp_path)}/run"
    code, err = run_cli([], Path(target), monkeypatch, capfd)
    assert code == 2 and f"hydra.run.dir='{target}' cannot be written" in err and "Traceback" not in err, err
