"""What a user's own code may still do with a model once ``ZeroEngine`` wraps it, and one clear
error for what it may not.

The engine replaces the model's parameters by views into its own buffers (stage 3: empty tensors
between gathers) and trains exactly the parameters the model had when it was wrapped. What a
researcher's own code does with such a model that would then go silently wrong, or fail later in
torch's words:

- ``model.state_dict()`` at stage 3 returns empty tensors (``torch.distributed.checkpoint`` would
  save them as such): refused, pointing at ``engine.consolidated_state_dict()`` /
  ``engine.save_checkpoint``. The hook sits on every submodule (``model.inner.state_dict()``, a
  ``transformers`` model's ``save_pretrained``), and stays after ``close()`` on each module whose
  parameters are still empty shards.
- ``model.load_state_dict(sd)`` (of the model or any submodule) writes into the compute copies only
  (stage 3: empty shards, a list of size mismatches); the fp32 masters the next step starts from
  keep the old weights: refused at every stage while the engine is open, pointing at loading before
  wrapping or ``engine.load_checkpoint``.
- a model still on the meta device, or without a trainable parameter, would fail in the forward
  or the backward: refused at construction (:func:`check_wrappable`).
- a second ``ZeroEngine(model)`` on a model an open engine wraps would re-point its parameters at
  new buffers behind the first engine's back, and on one a stage-3 engine wrapped (closed or not)
  would broadcast and shard its empty shards: refused before anything is sent
  (:func:`check_unwrapped`).
- a parameter added or replaced after wrapping is used by the forward but never updated (no
  unit, no optimizer state): ``train_step`` refuses it on every rank before any collective,
  naming it (the check reads the model alone, so every rank with the same change raises it).

The engine's own reads (``consolidated_state_dict``) run inside :meth:`ModelGuard.own_use`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

_WRAPPED: weakref.WeakKeyDictionary[nn.Module, ModelGuard] = weakref.WeakKeyDictionary()
"""Each model a ZeroEngine wrapped in this process -> that engine's guard."""


def check_wrappable(model: nn.Module) -> None:
    """Refuse, before anything is sent, a model ZeroEngine cannot wrap: one still on the meta device
    (its shapes would be broadcast and sharded, and the first forward fail on the device), one
    without a trainable parameter (the first backward would fail with torch's ``element 0 of
    tensors does not require grad``), or one another engine holds (:func:`check_unwrapped`)."""
    name = type(model).__name__
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{name}'s {meta!r} is on the meta device (a shape without values), so there is nothing to broadcast "
            f"or shard; materialize the model before wrapping it (model.to_empty(device=...) then initialise or "
            f"load its weights)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{name} has no trainable parameter (none with requires_grad=True), so ZeroEngine has nothing to train; "
            f"unfreeze the parameters to train (or add adapters, e.g. LoRA) before wrapping"
        )
    check_unwrapped(model)


def check_unwrapped(model: nn.Module) -> None:
    """Refuse a model another ZeroEngine holds (open), or emptied (stage 3, closed or not)."""
    guard = _WRAPPED.get(model)
    if guard is None or (guard.closed and guard.stage < 3):
        return
    if guard.stage == 3:
        raise ValueError(
            f"{type(model).__name__} was wrapped by a ZeroEngine at stage 3, which left its parameters as empty "
            f"shards (closed or not), so a new engine would shard nothing: build a fresh model (load "
            f"engine.consolidated_state_dict() into it for the trained weights) and wrap that"
        )
    raise ValueError(
        f"{type(model).__name__} is wrapped by an open ZeroEngine (stage {guard.stage}), whose buffers its "
        f"parameters view; call that engine's close() first, or wrap a fresh model"
    )


class ModelGuard:
    """The hooks above on ``model`` (wrapped at ``stage``) and the parameter check of each step."""

    def __init__(self, model: nn.Module, stage: int) -> None:
        self.stage = stage
        self._params = {id(p): n for n, p in model.named_parameters()}
        """``id(p)`` -> name of every parameter the model had when it was wrapped."""
        self._own = False
        self.closed = False
        _WRAPPED[model] = self
        mods = list(model.modules())  # a submodule's own state_dict / load_state_dict too
        self._handles: list[RemovableHandle] = [m.register_load_state_dict_pre_hook(self._on_load) for m in mods]
        self._state_handles: list[RemovableHandle] = (
            [m.register_state_dict_pre_hook(self._on_state_dict) for m in mods] if stage == 3 else []
        )

    @contextlib.contextmanager
    def own_use(self) -> Iterator[None]:
        """The engine's own ``state_dict`` reads (they replace the empty shards by gathered values)."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def _on_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.closed:
            # after close() the weights live nowhere but in these empty shards
            if any(p.numel() == 0 for p in module.parameters(recurse=False)):
                raise RuntimeError(
                    "model.state_dict() of a model a stage-3 ZeroEngine wrapped holds empty tensors after "
                    "engine.close() (each parameter is an empty shard and the engine's buffers are gone); call "
                    "engine.consolidated_state_dict() (collective: every rank calls it) before close() for the "
                    "full weights, or save them with engine.save_checkpoint(path) before close()"
                )
            return
        if not self._own:
            raise RuntimeError(
                "model.state_dict() of a model ZeroEngine wraps at stage 3 would hold empty tensors (each "
                "parameter is an empty shard between gathers); use engine.consolidated_state_dict() for the "
                "full weights (collective: every rank calls it) or engine.save_checkpoint(path) to save the "
                "training state"
            )

    def _on_load(self, module: nn.Module, *args: Any) -> None:
        place = "empty shards" if self.stage == 3 else "compute copies"
        raise RuntimeError(
            f"model.load_state_dict() on a model ZeroEngine wraps (stage {self.stage}) would write into the "
            f"engine's {place} while the fp32 masters the next step starts from keep the old weights; load the "
            f"weights into the model before ZeroEngine(model) wraps it, or resume with "
            f"engine.load_checkpoint(path)"
        )

    def check_params(self, model: nn.Module) -> None:
        """Raise if ``model``'s parameters are no longer the ones it was wrapped with."""
        now = {id(p): n for n, p in model.named_parameters()}
        if now.keys() == self._params.keys():
            return
        new = sorted(n for i, n in now.items() if i not in self._params)
        gone = sorted(n for i, n in self._params.items() if i not in now)
        what = "; ".join(
            f"{label} {', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("new:", new), ("no longer in the model:", gone))
            if names
        )
        raise RuntimeError(
            f"the model's parameters changed after ZeroEngine wrapped it ({what}); the engine trains only the "
            f"parameters the model had then, so a new one would never be updated: finish building the model "
            f"(add layers, tie weights, apply LoRA) before ZeroEngine(model) wraps it"
        )

    def remove(self) -> None:
        """The engine closed: its hooks go (the model may be wrapped again, stages 0-2), except stage 3's
        ``state_dict`` refusal, which then names ``consolidated_state_dict`` before ``close()``."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.closed = True
