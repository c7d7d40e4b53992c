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
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (a DDP loop's clip) found no
  ``p.grad`` (the gradients are reduced into the engine's shards and consumed by its step) and
  returned 0, clipping nothing; a ``loss.backward()`` of the model outside ``train_step`` trained
  nothing. Between steps every trainable parameter's ``.grad`` is a :class:`GradInEngine`: a
  tensor of the right shape with no storage whose every use (the norm, ``zero_()``, autograd
  adding into it) raises one error naming ``ZeroConfig.grad_clip`` and ``train_step``.
- ``engine.model.zero_grad()`` (``set_to_none=True``, also a torch optimizer's ``zero_grad()`` or
  ``p.grad = None``) removed the stand-ins, and ``clip_grad_norm_`` returned 0 again until the next
  step: ``zero_grad`` of the model (or a submodule) puts them back, and so does every listing of the
  parameters between steps (``model.parameters()`` / ``named_parameters()``, which is how
  ``clip_grad_norm_(model.parameters())`` and ``zero_grad`` find them); the engine's own steps and
  evaluations list them without that (a model's forward reading ``self.parameters()``).
- ``engine.model.half()`` / ``.to(dtype)`` / ``.bfloat16()`` (and ``.to(device)``, ``.cuda()``,
  ``.cpu()``, ``to_empty``: every conversion torch runs through ``Module._apply``) replaced each
  parameter's tensor by a converted copy that no longer viewed the engine's buffers (the engine
  would train its buffers and the forward use the copies), then failed on the first stand-in with
  the clip message: refused before anything changes, naming the parameter and what to set instead
  (``ZeroConfig(precision=...)``, or moving the model before wrapping). A conversion that changes no
  parameter (``.to()`` of the dtype and device they have, a cast of float buffers only) runs.
- a write into the parameters in place (``torch.distributed.checkpoint.load`` into
  ``model.state_dict()``, whose tensors alias the parameters at stages 0-2, or ``p.copy_`` under
  ``no_grad``) changed the compute copies only (or the masters too, where they are the same
  tensor): the next step overwrote it, or trained from a mix. :meth:`ModelGuard.written` finds it
  from the parameters' version counters, and ``train_step`` / ``eval_loss`` refuse it on every rank
  until ``engine.refresh_params()`` or ``engine.load_checkpoint``.

The engine's own reads (``consolidated_state_dict``) run inside :meth:`ModelGuard.own_use`.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_WRAPPED: weakref.WeakKeyDictionary[nn.Module, ModelGuard] = weakref.WeakKeyDictionary()
"""Each model a ZeroEngine wrapped in this process -> that engine's guard."""

_OPEN: weakref.WeakKeyDictionary[nn.Module, ModelGuard] = weakref.WeakKeyDictionary()
"""Each module (the model and every submodule) of a model an open engine wraps -> its guard: what the
module's own ``_apply`` / ``named_parameters`` / ``zero_grad`` below look up. A deep copy of the model
(an EMA copy) carries these methods but is no key here, so it behaves as a plain module."""


def _class_method(module: nn.Module, name: str) -> Callable[..., Any]:
    """The method ``name`` of ``module``'s class: the one its instance attribute (``_GUARDED``) shadows."""
    return getattr(type(module), name)


def _guarded_apply(module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    """``module._apply`` (what ``.to()``, ``.half()``, ``.cuda()`` ... run) while an engine wraps it."""
    guard = _OPEN.get(module)
    if guard is None:
        return _class_method(module, "_apply")(module, fn, recurse)
    return guard.apply(module, fn, recurse)


def _guarded_named_parameters(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """``module.named_parameters`` (and so ``parameters()``): the stand-in grads first put back."""
    guard = _OPEN.get(module)
    if guard is not None:
        guard.repark()
    return _class_method(module, "named_parameters")(module, *args, **kwargs)


def _guarded_zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    """``module.zero_grad``: torch's (which raises on a stand-in with ``set_to_none=False``), then
    the stand-ins are back (``set_to_none=True`` dropped them)."""
    _class_method(module, "zero_grad")(module, set_to_none)
    guard = _OPEN.get(module)
    if guard is not None:
        guard.repark()


_GUARDED: dict[str, Callable[..., Any]] = {
    "_apply": _guarded_apply,
    "named_parameters": _guarded_named_parameters,
    "zero_grad": _guarded_zero_grad,
}
"""Methods each module of a wrapped model gets as its own (instance) attributes while the engine is open."""
for _attr, _method in _GUARDED.items():
    _method.__name__ = _attr  # a bound method pickles by name: a pickled model gets its class's own back on load


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


GRADS_IN_ENGINE = (
    "the wrapped model's parameters hold no gradients: ZeroEngine reduces them into its own sharded buffers "
    "during train_step and consumes them in its optimizer step, so torch.nn.utils.clip_grad_norm_ over "
    "engine.model.parameters() (or reading, zeroing or accumulating p.grad) would see none; clip with "
    "ZeroConfig(grad_clip=...) (the global norm over every shard, applied inside train_step; train_step's "
    "result has grad_norm, the norm before clipping), and train with engine.train_step(micro_batches) instead "
    "of loss.backward() (evaluate with engine.eval_loss or a forward under torch.no_grad())"
)


class GradInEngine(torch.Tensor):
    """Stands in for ``p.grad`` of a wrapped parameter between steps: the parameter's shape, dtype
    and device, no storage, and every operation on it raises :data:`GRADS_IN_ENGINE` (module
    docstring: why). ``train_step`` drops it before its first backward."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> GradInEngine:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # (torch declares it as an attribute)
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(GRADS_IN_ENGINE)

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # (no values: none to print)
        return f"GradInEngine(shape={tuple(self.shape)}: {GRADS_IN_ENGINE.split(':')[0]})"


_VERSION = vars(torch._C.TensorBase)["_version"]
"""The tensor attribute that reads a tensor's version counter (torch has no public name for it)."""


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: torch adds one on every in-place write through ``t`` or a tensor
    sharing its counter (``t.detach()``, what ``state_dict()`` returns); not on writes through
    ``t.data`` or another view of the storage, which is how the engine writes its parameters."""
    return int(_VERSION.__get__(t))


class ModelGuard:
    """The hooks above on ``model`` (wrapped at ``stage``) and the parameter check of each step."""

    def __init__(self, model: nn.Module, stage: int) -> None:
        self.stage = stage
        self._params = {id(p): n for n, p in model.named_parameters()}
        """``id(p)`` -> name of every parameter the model had when it was wrapped."""
        self._named = list(model.named_parameters())
        self._versions = [version(p) for _, p in self._named]
        """Each parameter's version counter when the engine last wrote or checked it (:meth:`written`)."""
        self._own = False
        self._busy = False
        """Inside the engine's own step or evaluation: no stand-in is put back (:meth:`repark`)."""
        self._applying = False
        self.closed = False
        _WRAPPED[model] = self
        mods = list(model.modules())  # a submodule's own state_dict / load_state_dict too
        self._modules = mods
        for m in mods:
            _OPEN[m] = self
            for attr, method in _GUARDED.items():
                m.__dict__[attr] = types.MethodType(method, m)  # found before the class's (module docstring)
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
        already = (
            "; torch.distributed.checkpoint.load has already written the loaded values into the parameters in "
            "place (the next train_step refuses them; engine.refresh_params() rebuilds the parameters from the "
            "engine's masters)"
            if self.written()
            else ""
        )
        raise RuntimeError(
            f"model.load_state_dict() on a model ZeroEngine wraps (stage {self.stage}) would write into the "
            f"engine's {place} while the fp32 masters the next step starts from keep the old weights; load the "
            f"weights into the model before ZeroEngine(model) wraps it, or resume with "
            f"engine.load_checkpoint(path){already}"
        )

    def park_grads(self) -> None:
        """Between steps: every trainable parameter's ``.grad`` becomes a :class:`GradInEngine`."""
        for _, p in self._named:
            if p.requires_grad:
                p.grad = GradInEngine(p)

    def repark(self) -> None:
        """Put back each stand-in that was set to None since (``zero_grad``, ``p.grad = None``),
        except inside the engine's own step or evaluation."""
        if self._busy or self.closed:
            return
        for _, p in self._named:
            if p.requires_grad and p.grad is None:
                p.grad = GradInEngine(p)

    @property
    def busy(self) -> bool:
        """Inside the engine's own step or evaluation (:meth:`engine_call`)."""
        return self._busy

    @contextlib.contextmanager
    def engine_call(self, *, step: bool) -> Iterator[None]:
        """The engine's own step (``step``) or evaluation: no stand-in is put back meanwhile (a
        model's forward may list its parameters); all are in place at its end (a step: every
        ``.grad`` replaced, whatever the step left there)."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            if step:
                self.park_grads()
            else:
                self.repark()

    def apply(self, module: nn.Module, fn: Any, recurse: bool) -> nn.Module:
        """``module._apply(fn)``: refused, before anything changes, if ``fn`` would replace a
        parameter (module docstring); else torch's, with the stand-ins set aside meanwhile."""
        if self._applying:  # a submodule's, inside the call checked below
            return _class_method(module, "_apply")(module, fn, recurse)
        for name, p in _class_method(module, "named_parameters")(module, recurse=recurse):
            with torch.no_grad():
                out = fn(p)
            if out is not p:
                raise self._apply_error(self._params.get(id(p), name), p, out)
        self._applying = True
        aside = [p for _, p in self._named if isinstance(p.grad, GradInEngine)]
        try:
            for p in aside:
                p.grad = None  # (torch's _apply would convert it too)
            return _class_method(module, "_apply")(module, fn, recurse)
        finally:
            self._applying = False
            for p in aside:  # (inside the engine's step there are none: its gradients stay as they are)
                p.grad = GradInEngine(p)

    def _apply_error(self, name: str, p: torch.Tensor, out: object) -> RuntimeError:
        """The refusal of a conversion that would replace parameter ``name`` by ``out``."""
        to = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        advice = []
        if not isinstance(out, torch.Tensor) or out.dtype != p.dtype:
            advice.append(
                "choose the compute dtype with ZeroConfig(precision='bf16' or 'fp16') when building the engine "
                "(it casts the parameters and keeps fp32 masters), and cast inputs or float buffers yourself"
            )
        if not isinstance(out, torch.Tensor) or out.device != p.device:
            advice.append("move the model to its device before ZeroEngine(model) wraps it")
        return RuntimeError(
            f"converting or moving the wrapped model (Module.half(), .bfloat16(), .float(), .to(dtype or device), "
            f".cuda(), .cpu(), .to_empty(): torch's Module._apply) would replace its parameter {name!r} "
            f"({p.dtype} on {p.device}) by a copy ({to}) that ZeroEngine neither trains nor refreshes: the "
            f"parameters view the engine's own buffers, whose dtype and device are fixed when it wraps the model; "
            f"nothing was changed: {'; '.join(advice or ['make the change before ZeroEngine(model) wraps it'])} "
            f"(a conversion that changes no parameter, e.g. of float buffers only, runs)"
        )

    def written(self) -> list[str]:
        """Names of the parameters written in place by anyone but the engine since :meth:`settle`."""
        return [n for (n, p), v in zip(self._named, self._versions) if version(p) != v]

    def settle(self) -> None:
        """The parameters as they are now are the engine's (after its own writes, or a refresh)."""
        self._versions = [version(p) for _, p in self._named]

    def written_error(self) -> RuntimeError | None:
        """The error :meth:`written` parameters make (None if there are none), naming what to use."""
        names = self.written()
        if not names:
            return None
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return RuntimeError(
            f"the wrapped model's parameters {shown} were written in place outside ZeroEngine (e.g. "
            f"torch.distributed.checkpoint.load into engine.model.state_dict(), whose tensors are the parameters, "
            f"or an in-place op on a parameter), but the engine trains its own fp32 masters and optimizer state, "
            f"so the next step would overwrite the written values or train from a mix; resume with "
            f"engine.load_checkpoint(path) (a checkpoint of engine.save_checkpoint), or load the weights into the "
            f"model before ZeroEngine(model) wraps it; engine.refresh_params() (collective) rebuilds the "
            f"parameters from the engine's masters and lets training go on"
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
        for m in self._modules:
            _OPEN.pop(m, None)
            for attr in _GUARDED:
                m.__dict__.pop(attr, None)
        self._modules = []
        for _, p in self._named:
            if isinstance(p.grad, GradInEngine):
                p.grad = None  # a plain model again (stages 0-2)
        self.closed = True
