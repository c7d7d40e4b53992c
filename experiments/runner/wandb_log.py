"""wandb logging that can never stop or hang a run.

Offline by default (``logger.mode=offline``: files under ``<run dir>/wandb``, no network; sync later
with ``wandb sync``); online only when configured. Init has a timeout, and any wandb error turns
logging off with one warning instead of failing training. Only rank 0 logs. Runs of one sweep
share a group (the sweep directory's name) so wandb shows them together.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

from .config import LoggerConfig

log = logging.getLogger(__name__)


class WandbLogger:
    """A thin, failure-proof wrapper around a wandb run (no-op when disabled)."""

    def __init__(
        self,
        settings: LoggerConfig,
        *,
        run_dir: Path,
        name: str,
        group: str | None,
        config: dict[str, Any],
        tags: list[str] | None = None,
    ) -> None:
        self.run: Any = None
        self.dir: str | None = None
        if not settings.enabled:
            return
        try:
            if settings.mode == "offline":
                os.environ["WANDB_MODE"] = "offline"  # also for anything wandb spawns
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.run = wandb.init(
                mode=cast(Any, str(settings.mode)),
                dir=str(run_dir),
                project=settings.project,
                entity=settings.entity,
                group=settings.group or group,
                name=name,
                config=config,
                tags=tags,
                settings=wandb.Settings(
                    init_timeout=settings.init_timeout_s,
                    console="off",
                    silent=True,
                    disable_git=True,
                    save_code=False,
                    x_disable_stats=True,
                ),
                reinit="finish_previous",
            )
            self.dir = str(Path(self.run.dir).parent)
        except Exception as e:
            log.warning("warning: wandb disabled for this run (training goes on): %s", init_failure(e, settings))
            self.run = None

    def log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(data, step=step)
        except Exception as e:
            log.warning("warning: wandb logging stopped: %s", e)
            self.run = None

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        if self.run is None:
            return
        try:
            for k, v in (summary or {}).items():
                self.run.summary[k] = v
            self.run.finish()
        except Exception as e:
            log.warning("warning: wandb finish failed: %s", e)
        self.run = None


def init_failure(e: Exception, settings: LoggerConfig) -> str:
    """One line for a failed ``wandb.init``: wandb's own first line (its timeout adds advice to
    change ``wandb.Settings(init_timeout=...)`` in code, which a runner user cannot; the runner's
    setting for it is named instead)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else "(no message)"
    line = f"{type(e).__name__}: {first}"
    if "init_timeout" in text or "Timed out" in first:
        line += (
            f" (wandb gave up after logger.init_timeout_s={settings.init_timeout_s:g} s: raise it, "
            "or log offline with logger.mode=offline and sync later with `wandb sync`)"
        )
    return line


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"a/b": v}`` of scalars (wandb charts want flat scalar keys)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out
