"""``python -m experiments.mixz``'s command line: a preset, LoRA rank or learning rate that every
rank would refuse is a usage error (exit 2) before any rank starts, not the ranks' traceback."""

from __future__ import annotations

import pytest

from zeropp.experiments.studies import mixz


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--preset", "huge"], "unknown GPT preset 'huge'; choose one of"),  # before: a ValueError traceback
        (["--lr", "nan"], "OptimizerConfig.lr must be a finite number >= 0, got nan"),  # before: a traceback
        (["--lr", "-1"], "OptimizerConfig.lr must be a finite number >= 0"),
    ],
)
def test_bad_values_are_usage_errors_before_any_rank(argv: list[str], words: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(mixz, "run", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(SystemExit) as e:
        mixz.main(["--steps", "1", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err
