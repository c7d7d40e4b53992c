"""The training step and evaluation of ``ZeroEngine``.

``train_step`` runs forward and backward of every micro-batch (the per-micro-step checks every
rank passes before backward, the stage-2/3 reductions during backward), then the optimizer step
(``update.py``); ``eval_loss`` is the forward without gradients, averaged over the ranks. The
life of a step is told in ``engine.py``'s docstring.

Host reads: a step reads one device value back, the all-reduced ``[loss, squared norms]`` that
decides skip and clip (``update.py``), so the host can queue the step's forwards and backwards
ahead of the GPU; stage 2-3's count of late gradients travels in that all-reduce too. The
per-micro-step checks every rank must pass before backward (a forward that raised on some rank,
stage 3's blocks-ran check) exchange host values on a host group (``batch.control_group``: gloo
next to NCCL), which never waits for the GPU.

A user's loop around the engine (``wrapped.py``): between steps every trainable parameter's
``.grad`` is a ``GradInEngine`` (``clip_grad_norm_`` or a ``backward`` outside ``train_step`` raise,
naming ``ZeroConfig.grad_clip``); a step first refuses, on every rank through the forward's
agreement, parameters written in place since the engine's last write (``ModelGuard.written``; an
evaluation uses what they hold); ``eval_loss`` first checks that every rank called it (``rollcall.py``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .batch import agree_on_forward, call_model, differentiable, loss_of
from .engine_memory import EngineMemory
from .update import StepResult


class EngineSteps(EngineMemory):
    """``ZeroEngine``'s ``train_step`` and ``eval_loss`` (see the module docstring)."""

    def train_step(self, micro_batches: Sequence[Any]) -> StepResult:
        """Forward/backward every micro-batch, then clip and step. Collective.

        A micro-batch is whatever the model takes: a dict (``model(**mb)``), a tuple (``model(*mb)``,
        e.g. ``(idx, targets)``), a ``WithTargets(inputs, targets)`` (the model gets the inputs) or one
        object (``model(mb)``); the loss is ``loss_fn(output, mb)``
        or found in the output (``zeropp.runtime.batch.loss_of``). An error in one rank's
        forward (or loss) is raised on every rank, after one small exchange, instead of leaving
        the other ranks waiting in the next collective."""
        self._check_open()
        self.guard.check_params(self.model)  # a parameter added after wrapping would never be trained
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_step was called under torch.no_grad() (or inference_mode), where its backward has nothing "
                "to differentiate; call it with gradients enabled (eval_loss is the no-grad forward)"
            )
        a = self.cfg.grad_accum_steps
        if not isinstance(micro_batches, Sequence):  # an iterator or generator of micro-batches
            micro_batches = list(micro_batches)
        if len(micro_batches) != a:
            raise ValueError(
                f"train_step got {len(micro_batches)} micro-batches but grad_accum_steps={a}; pass a list of exactly "
                f"{a} (one micro-batch (x, y) is train_step([(x, y)]))"
            )
        written = self.guard.written_error()  # parameters written in place since the engine's last write
        self._forward_checked = False  # the next forward of the user's own (stage 3) gets the roll call
        with self.guard.engine_call(step=True):  # p.grad: stand-ins again at its end (wrapped.py)
            res = self._step(micro_batches, written)
        self.guard.settle()
        return res

    def _step(self, micro_batches: Sequence[Any], written: RuntimeError | None) -> StepResult:
        """:meth:`train_step` once its arguments are checked; ``written``: refused on every rank."""
        a = self.cfg.grad_accum_steps
        t0 = time.perf_counter()
        self.comm.reset_wait()
        scale = self.scaler.scale
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, with the norm (update.py)
        self.reducer.start_step()
        for j, mb in enumerate(micro_batches):
            self.reducer.start_micro_step(last=j == a - 1)
            loss, error = None, None
            if self.stage3 is not None:
                self.stage3.training_forward = True  # (ZeroConfig.keep_at_turn: units backward needs first stay)
            try:
                if j == 0 and written is not None:
                    raise written  # through the check below: raised on every rank, before any collective
                with self.activations.saving():
                    loss = differentiable(loss_of(call_model(self.model, mb), mb, self.loss_fn))
            except Exception as exc:
                error = exc
            finally:
                if self.stage3 is not None:
                    self.stage3.training_forward = False
            # the same blocks ran on every rank and no rank failed, else one clear error everywhere; no rank
            # goes on to backward's reductions alone (deferred to this rank's next collective: batch.py)
            if self.stage3 is not None:
                later = self.stage3.check_forward(error, defer=self._defer_checks)
            else:
                later = agree_on_forward(error, self._control, defer=self._defer_checks)
            if later is not None:
                self.comm.defer_until_next_collective(later)
            try:
                if j == a - 1:
                    self._record_phase("forward")  # activations saved for backward are alive now
                if self.stage3 is not None:
                    self.stage3.before_backward()  # the root, whatever form the output and the loss take
                assert loss is not None  # (the check above raised this rank's forward error)
                loss_sum += loss.detach().to(device=self.device, dtype=torch.float64)  # stays on the device
                (loss * (scale / a)).backward()
            except Exception as exc:
                # this rank's backward raised before the verdict was read: read it now (a failed peer waits
                # for this rank in the verdict's exchange), and raise what it says, chained to the error
                try:
                    self.comm.run_deferred()
                except Exception as verdict:
                    raise verdict from exc
                raise
            self.comm.run_deferred()  # a backward without collectives: the verdict before going on
            self._after_backward(last=j == a - 1)
        grads = self.reducer.final_grads()
        res = self.update.step(
            grads,
            loss_sum / a,
            self._last_memory,
            late=self.reducer.late_grads(),  # summed with the loss: raised on every rank before any update
            on_late=self.reducer.raise_late_grads,
        )
        self._record_phase("step")
        res.step_time_s = time.perf_counter() - t0
        return res

    @torch.no_grad()
    def eval_loss(self, *batch: Any, local: bool = False) -> float:
        """Loss on a batch without gradients, averaged over ranks. Collective (stage 3 gathers).

        ``eval_loss(idx, targets)`` calls ``model(idx, targets)`` as before; one argument is a
        micro-batch as in :meth:`train_step` (a dict, a tuple or one object). Every rank must call
        it: a rank that waited ``call_timeout`` (``ZeroEngine``) for the others raises, naming the
        ranks that did not come, before anything is sent (``rollcall.py``). ``local=True``: this
        rank's loss on its batch, with no collective (callable on one rank, e.g. under
        ``if rank == 0:``), where the forward needs no other rank: stages 0-2 without tensor
        parallelism or ``SyncBatchNorm``."""
        self._check_open()
        if not batch:
            raise TypeError("eval_loss needs a batch: eval_loss(micro_batch) or eval_loss(*model_args)")
        if local:
            self._check_local_eval()
        else:
            self._check_every_rank_called("eval_loss")
        mb = batch[0] if len(batch) == 1 else tuple(batch)
        loss = 0.0
        # Evaluates what the parameters hold, written from outside or not (evaluating EMA weights copied
        # in is a user's right; the next train_step refuses such writes). Writes the forward itself
        # makes (a model clamping its own parameter) are the model's, as in training: settled, unless
        # an outside write came first (which must stay visible to train_step).
        outside = bool(self.guard.written())
        error: Exception | None = None
        try:
            with self.guard.engine_call(step=False):
                loss = float(loss_of(call_model(self.model, mb), mb, self.loss_fn))
        except Exception as exc:
            error = exc
        if not outside:
            self.guard.settle()
        if local:
            if error is not None:
                raise error
            return loss
        if self.stage3 is not None:
            try:
                self.stage3.check_forward(error)  # as in training: one rank's error raised on every rank
            finally:
                self.stage3.release_all()
        else:
            agree_on_forward(error, self._control)  # before the sum below, which would wait for the failed rank
        return self.comm.sum_scalars([loss])[0] / self._all_ranks

    def _check_local_eval(self) -> None:
        """Refuse ``eval_loss(local=True)`` where the forward itself needs the other ranks."""
        if self.stage3 is not None:
            why = "at stage 3 its forward gathers every block's parameters from every rank"
        elif not self._defer_checks:
            why = "its forward runs collectives of its own (tensor parallelism or SyncBatchNorm)"
        else:
            return
        raise ValueError(
            f"eval_loss(..., local=True) evaluates on this rank alone, but {why}; call eval_loss(batch) on every "
            f"rank (the loss averaged over ranks), or evaluate a plain model loaded with "
            f"engine.consolidated_state_dict() (collective too: every rank calls it)"
        )

    # ------------------------------------------------------------------ gradients
    def _after_backward(self, last: bool) -> None:
        """After each micro-step's backward: the reductions of stages 2-3 are done (``reduction.py``),
        stage 3 frees what is still gathered; after the last one, the backward memory is recorded."""
        self.reducer.finish_backward()
        if self.stage3 is not None:
            self.stage3.release_all()
        if last:
            self._last_memory = self._measure_memory()
            self._record_phase("backward")
