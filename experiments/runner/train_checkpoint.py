"""The training loop's checkpoints and its divergence rule: resume, save, and nothing saved from a
diverged state.

Divergence (``zeropp.runtime.divergence.DivergenceGuard``, :func:`divergence_guard`): the loop
judges each step's globally reduced loss, gradient norm and skip flag, so every rank stops at the
same step, before that step's evaluation and checkpoint. A diverged step is never saved, so the
last good checkpoint stays ``LATEST``, and the error says where it is
(:meth:`Checkpointer.explain`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from zeropp.models import HFConfig
from zeropp.runtime.divergence import DivergenceError, DivergenceGuard

from ..launch import heartbeat
from .config import RunConfig
from .run_dir_checks import MODEL_KEYS_FREE_ON_RESUME
from .trainers import Trainer


def resume_keys(cfg: RunConfig) -> dict[str, Any]:
    """The settings a resumed run must keep to continue exactly as an uninterrupted one, as plain
    JSON values. The stage, the offload tiers and the node layout may change (the checkpoint
    reshards, the same steps follow); the number of data-parallel ranks may too, but each of them
    draws its own micro-batches (``data.TokenBatches``, seeded by its rank), so another count
    trains on other data with another global batch: it is listed (``topology.dp_size``)."""
    return json.loads(
        json.dumps(
            {
                "train.seed": cfg.train.seed,
                "train.micro_batch_size": cfg.train.micro_batch_size,
                "topology.dp_size": cfg.topology.dp_size,
                "train.steps": cfg.train.steps,
                "zero.grad_accum_steps": cfg.zero.grad_accum_steps,
                "data": dataclasses.asdict(cfg.data),
                "optim": dataclasses.asdict(cfg.optim),
            }
        )
    )


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``: nested settings as dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


def divergence_guard(cfg: RunConfig) -> DivergenceGuard:
    """The run's divergence rule, its advice in the runner's config keys."""
    z = cfg.zero
    if z.precision == "fp16":
        advice = (
            f"lower zero.loss_scale_init (now {z.loss_scale_init:g}) or optim.lr (now {cfg.optim.lr:g}), "
            "or train in bf16 (zero.precision=bf16)"
        )
    else:
        clip = "set zero.grad_clip=1.0" if z.grad_clip is None else f"clip harder (zero.grad_clip is {z.grad_clip:g})"
        advice = f"lower optim.lr (now {cfg.optim.lr:g}), {clip}, or check the data for bad values"
    return DivergenceGuard(
        loss_scaling=z.precision == "fp16",
        max_skipped_steps=cfg.train.max_skipped_steps,
        advice=advice,
        max_skipped_name="train.max_skipped_steps",
    )


class Checkpointer:
    """Resume from and save to the run's checkpoint directory (``RunConfig.checkpoint_dir``)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, trainer: Trainer, *, lead: bool) -> None:
        self.cfg, self.trainer, self.lead = cfg, trainer, lead
        self.run_dir = str(Path(run_dir).resolve())
        """Saved with each checkpoint, so a resume can tell its own checkpoints from another run's in a
        shared directory (``run_dir_checks.check_resumes_its_own``)."""
        self.dir = cfg.checkpoint_dir(run_dir)
        """Where the versions and ``LATEST`` live."""
        self.saved: str | None = None
        """The directory this run saved to, once it has (the summary's ``checkpoint``)."""
        self.saved_step: int | None = None
        """The step of the newest checkpoint this run can fall back to (resumed from or saved)."""
        self.transformers_config: dict[str, Any] | None = None
        """``model=hf``: the ``transformers`` config the model was built with, kept in each checkpoint
        so the export rebuilds that model (``model.pretrained``'s directory may be gone by then)."""
        if isinstance(cfg.model, HFConfig):
            from zeropp.models.hf import recorded_config

            self.transformers_config = recorded_config(cfg.model)

    def model_record(self) -> dict[str, Any]:
        """The model's settings as a checkpoint records them: ``model.*``, with ``model.pretrained``
        made absolute against this rank's working directory (where the run read it), so the export,
        run from anywhere, reads that directory and never a same-named one under its own."""
        model = self.cfg.to_dict()["model"]
        if isinstance(model.get("pretrained"), str):
            model = {**model, "pretrained": str(Path(model["pretrained"]).expanduser().absolute())}
        return model

    def transport(self) -> str | None:
        """What carried the trainer's plain collectives, as resolved (``zero.transport``: ``shm`` or
        ``backend``); None for a trainer without that choice. Recorded by each checkpoint because
        ``auto`` may resolve otherwise on resume (another host, less ``/dev/shm``), and the
        all-reduces of the two transports differ in the last bit."""
        session = self.trainer.comm_session()
        choice = getattr(session, "transport", None)
        return None if choice is None else str(choice.resolved)

    def resume(self) -> int:
        """Collective: with ``resume=true`` load the newest checkpoint and return its step (the
        run continues after it); else 0. A checkpoint of a finished run is refused; changed
        settings that make the continuation differ from an uninterrupted run are warned about."""
        if not self.cfg.resume:
            return 0
        t = self.cfg.train
        heartbeat("checkpoint_load", long=True)
        extra = self.trainer.load(self.dir)
        start = int(extra["step"])
        if start >= t.steps:
            raise RuntimeError(
                f"the checkpoint in {self.dir} is at step {start} and train.steps={t.steps}: this run "
                "already finished; to train further raise train.steps (the default LR schedule "
                "spans train.steps, so it changes too)"
            )
        now = _leaves(resume_keys(self.cfg))
        was = _leaves(extra.get("run", {}) if isinstance(extra.get("run"), dict) else {})
        keys = [k for k, v in sorted(now.items()) if k in was and was[k] != v]
        changed = [f"{k} {was[k]!r} -> {now[k]!r}" for k in keys]
        model, saved = self.model_record(), extra.get("model")
        for k in MODEL_KEYS_FREE_ON_RESUME:  # the others must match (run_dir_checks.check_resumes_its_model)
            if isinstance(saved, dict) and k in saved and saved[k] != model.get(k):
                why = " (the weights come from the checkpoint)" if k == "pretrained" else ""
                if k != "pretrained":  # (the config it builds was checked equal, the weights are the checkpoint's:
                    keys.append(f"model.{k}")  # listed when something else warns, no reason to warn alone)
                changed.append(f"model.{k} {saved[k]!r} -> {model.get(k)!r}{why}")
        transport, saved_transport = self.transport(), extra.get("transport")
        if transport is not None and saved_transport != transport:
            keys.append("transport")
            was_t = "not recorded" if saved_transport is None else repr(saved_transport)
            changed.append(
                f"the transport of the plain collectives {was_t} -> {transport!r} (zero.transport: its "
                "all-reduces, stages 0-1 and stage 3's persisted parameters, differ in the last bit; pin "
                "zero.transport to the checkpoint's to continue it exactly)"
            )
        # train.steps alone changes nothing of the steps both runs take (raising it is how a run trains
        # on): warn only when something else differs; then it is listed too, as the reason a derived
        # default moved (the LR schedule's length follows train.steps), not an unexplained "optim"
        if set(keys) - {"train.steps"} and self.lead:
            print(
                f"warning: resumed with changed settings: {'; '.join(changed)}. Training continues from the "
                "checkpoint but will not match an uninterrupted run",
                file=sys.stderr,
                flush=True,
            )
        self.saved_step = start
        return start

    def due(self, step: int) -> bool:
        """Whether ``step`` saves: every ``train.checkpoint_every`` steps and the last step."""
        every = self.cfg.train.checkpoint_every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def after_step(self, step: int, *, diverged: bool) -> bool:
        """Collective: save ``step`` when due, unless it diverged (nothing is saved from a diverged
        state: the last good checkpoint stays ``LATEST``). Returns whether it saved."""
        if diverged or not self.due(step):
            return False
        heartbeat("checkpoint_save", step, long=True)
        # "model": the model's settings, so the checkpoint alone rebuilds it (python -m experiments.export)
        extra = {"step": step, "run": resume_keys(self.cfg), "model": self.model_record(), "run_dir": self.run_dir}
        if (transport := self.transport()) is not None:
            extra["transport"] = transport  # compared on resume (auto may resolve otherwise then)
        if self.transformers_config is not None:
            extra["transformers_config"] = self.transformers_config
        self.trainer.save(self.dir, extra, keep=self.cfg.train.keep_checkpoints)
        self.saved, self.saved_step = str(self.dir), step
        return True

    def explain(self, err: DivergenceError, step: int) -> DivergenceError:
        """``err`` with where the newest good checkpoint is, when there is one."""
        if self.saved_step is None:
            return err
        return err.with_note(
            f"Nothing of step {step} was saved; the newest checkpoint, of step {self.saved_step}, is in {self.dir}."
        )
