"""The runner's wandb wrapper when wandb cannot start: one warning line, training goes on."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest

from zeropp.experiments.runner.sections import LoggerConfig
from zeropp.experiments.runner.wandb_log import WandbLogger

WANDB_TIMEOUT = (
    'Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: lookup api.wandb.ai: no such host\n'
    "Consider increasing the init_timeout setting:\n"
    "  wandb.init(settings=wandb.Settings(init_timeout=...))"
)
"""What wandb 0.2x raises (``CommError``) when ``logger.mode=online`` finds no server in time."""


class CommError(Exception):
    pass


def _fake_wandb(error: Exception) -> types.ModuleType:
    fake = types.ModuleType("wandb")

    def init(**kw: object) -> None:
        raise error

    fake.init = init  # type: ignore[attr-defined]
    fake.Settings = lambda **kw: kw  # type: ignore[attr-defined]
    return fake


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (
            CommError(WANDB_TIMEOUT),
            'CommError: Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: lookup '
            "api.wandb.ai: no such host (wandb gave up after logger.init_timeout_s=5 s: raise it, or log offline "
            "with logger.mode=offline and sync later with `wandb sync`)",
        ),
        (ImportError("No module named 'wandb'"), "ImportError: No module named 'wandb'"),
    ],
)
def test_a_wandb_that_cannot_start_is_one_warning_line_naming_the_runners_setting(
    error: Exception, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """wandb's timeout error ends in advice to change ``wandb.init(settings=...)``, code a runner
    user does not write; the warning is its first line and names ``logger.init_timeout_s``."""
    monkeypatch.setitem(__import__("sys").modules, "wandb", _fake_wandb(error))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with caplog.at_level(logging.WARNING):
        w = WandbLogger(
            LoggerConfig(mode="online", init_timeout_s=5.0), run_dir=tmp_path, name="n", group=None, config={}
        )
    assert w.run is None
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: wandb disabled for this run (training goes on): {says}"
    ]
    w.log({"loss": 1.0}, step=1)  # a no-op, as is finish
    w.finish({"loss": 1.0})
