"""How the engine calls a model on a micro-batch and finds the loss in what it returns.

The engine wraps any ``nn.Module``, so neither the forward's signature nor the output's form is
fixed. One rule for each, the same in ``train_step`` and ``eval_loss``:

- the call (:func:`call_model`): a micro-batch that is a ``dict`` (any ``Mapping``) is passed as
  keyword arguments, ``model(**mb)``; a ``tuple`` as positional arguments, ``model(*mb)`` (so the
  GPT's ``(idx, targets)`` works as before); a :class:`WithTargets` passes only its ``inputs``, by
  the same rule, and keeps its ``targets`` for the loss; anything else (a tensor, a list, an
  object) as the one argument, ``model(mb)``. Arguments the model's ``forward`` cannot take are a
  :class:`MicroBatchError` that shows the call and how to pass targets, instead of the forward's
  bare ``TypeError`` (which stage 3 would report with a hint about block parameters).
- the loss (:func:`loss_of`): ``loss_fn(output, mb)`` when the engine was given one; otherwise
  taken from the output: a scalar tensor is the loss; a mapping's ``"loss"`` entry (Hugging Face's
  ``ModelOutput`` is one); an object's ``loss`` attribute; a tuple's or list's last element (the
  GPT's ``(logits, loss)``). It must be a one-element floating tensor; anything else is a
  ``ValueError`` saying what was found and how to pass a ``loss_fn``.

And one rule for a forward that raises on some ranks only (:func:`agree_on_forward`): every rank
learns it after the forward, with one small all-reduce, and raises the same error, instead of
the healthy ranks waiting in backward's first collective until the timeout. (Stage 3 does this
inside its own after-forward check, ``Stage3Hooks.check_forward``.)

That check must stay per micro-step (backward's collectives may not start on any rank while
another rank's forward failed), but what it exchanges is known on the host (an exception, block
counters), so it travels on the host: :func:`control_group` gives a gloo group when the default
group cannot carry CPU tensors (NCCL), and :func:`host_max` all-reduces plain ints there. A
device all-reduce would make every micro-step wait for the GPU to finish the forward before the
host could queue the backward.

A rank whose forward succeeded need not wait for the check right away either: it only has to
know the verdict before its next collective. So the engine issues the all-reduce without waiting
(:func:`host_max_start`, ``defer=True``) and reads it at its next collective or at the end of the
micro-step's backward, whichever comes first (``EngineComm.defer_until_next_collective``): the
backward's first blocks compute while the check travels, and the ranks do not meet at a barrier
after every forward (on CPU ranks sharing cores, that barrier cost about 3% of a step). A rank
whose forward raised still waits at once, and a rank that learns late of another's failure
raises the same error from its backward, before sending anything. Not deferred where a
collective can run inside backward outside the engine (tensor parallelism, ``SyncBatchNorm``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm import ranges
from zeropp.comm.backend import control_all_reduce
from zeropp.comm.kinds import CommKind

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, micro_batch) -> scalar loss tensor``."""


@dataclass(frozen=True)
class WithTargets:
    """A micro-batch whose targets the model does not take: the engine calls the model on
    ``inputs`` alone (a dict, a tuple or one object, by the rule above) and hands the whole
    micro-batch to ``loss_fn(output, mb)``, which reads ``mb.targets``. For a plain module such as
    an ``nn.Sequential`` regression::

        engine = ZeroEngine(mlp, loss_fn=lambda out, mb: F.mse_loss(out, mb.targets), ...)
        engine.train_step([WithTargets(x, y)])
    """

    inputs: Any
    """What the model is called on."""
    targets: Any
    """What the loss compares the output with; the model never sees it."""


class MicroBatchError(TypeError):
    """The micro-batch does not fit the model's ``forward`` signature."""


def _split(mb: Any) -> tuple[tuple, dict, str]:
    """``(args, kwargs, how)``: the call the rule makes of ``mb`` and a phrase saying why."""
    inputs, prefix = (mb.inputs, "WithTargets.inputs: ") if isinstance(mb, WithTargets) else (mb, "")
    if isinstance(inputs, Mapping):
        return (), dict(inputs), prefix + "a dict micro-batch is passed as keyword arguments, model(**mb)"
    if isinstance(inputs, tuple):
        return inputs, {}, prefix + "a tuple micro-batch is unpacked into positional arguments, model(*mb)"
    return (inputs,), {}, prefix + "a micro-batch that is not a dict or a tuple is the one argument, model(mb)"


def call_model(model: nn.Module, mb: Any) -> Any:
    """``model(**mb)`` for a mapping, ``model(*mb)`` for a tuple, ``model(<inputs by the same rule>)``
    for a :class:`WithTargets`, else ``model(mb)``. A call that raises ``TypeError`` while its
    arguments do not bind to ``model.forward``'s signature is re-raised as :class:`MicroBatchError`
    (the signature is read only after a failure: a working call costs nothing, and a forward
    pre-hook that supplies arguments is not second-guessed)."""
    args, kwargs, how = _split(mb)
    try:
        return model(*args, **kwargs)
    except TypeError as exc:
        msg = _call_mismatch(model, args, kwargs, how)
        if msg is None:
            raise
        raise MicroBatchError(msg) from exc


def _call_mismatch(model: nn.Module, args: tuple, kwargs: dict, how: str) -> str | None:
    """Why ``model(*args, **kwargs)`` does not fit ``model.forward``, or None if it does (or the
    signature cannot be read)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as why:
        shown = ", ".join([_short(a) for a in args] + [f"{k}={_short(v)}" for k, v in kwargs.items()])
        name = type(model).__name__
        return (
            f"the engine called the model as {name}({shown}) ({how}), which {name}.forward{sig} does not "
            f"accept: {why}. If the micro-batch holds the model's inputs and the targets of the loss, pass "
            f"WithTargets(inputs, targets) micro-batches (zeropp.runtime.WithTargets: the model gets only the "
            f"inputs) and a loss that reads mb.targets, ZeroEngine(..., loss_fn=callable(output, mb) -> loss), "
            f"e.g. loss_fn=lambda output, mb: F.mse_loss(output, mb.targets); a model that computes its own "
            f"loss, like the GPT's forward(idx, targets), takes the tuple as it is"
        )
    return None


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"<{str(x.dtype).removeprefix('torch.')} {list(x.shape)}>"
    return f"<{type(x).__name__}>"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def loss_of(output: Any, mb: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of one micro-batch (see the module docstring for the rule)."""
    loss: object  # whatever the model or loss_fn returned; checked below
    if loss_fn is not None:
        loss, where = loss_fn(output, mb), "loss_fn(output, micro_batch)"
    elif isinstance(output, torch.Tensor):
        loss, where = output, "the model's output"
    elif isinstance(output, Mapping):
        loss, where = output.get("loss"), "the model's output['loss']"
    elif getattr(output, "loss", None) is not None:
        loss, where = output.loss, "the model's output.loss"
    elif isinstance(output, (tuple, list)) and len(output) > 0:
        loss, where = output[-1], "the last element of the model's output"
    else:
        loss, where = None, f"the model's output ({_describe(output)})"
    if loss is None:
        raise ValueError(
            f"no loss in {where}: the model returned no loss (call it with targets / labels in the "
            f"micro-batch), or pass ZeroEngine(..., loss_fn=callable(output, micro_batch) -> loss)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"{where} is {_describe(loss)}, not a one-element floating loss; return a scalar loss, or "
            f"pass ZeroEngine(..., loss_fn=callable(output, micro_batch) -> loss)"
        )
    return loss.reshape(())


def differentiable(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, checked for a training step: it must require grad, else backward fails with torch's
    ``element 0 of tensors does not require grad``, which names neither the loss nor the cause."""
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad, so backward has nothing to differentiate: it was computed outside "
            "autograd (under torch.no_grad(), from .detach()ed or .item() values) or from no trainable parameter; "
            "return the loss tensor the forward computed"
        )
    return loss


ON_RANKS = re.compile(r"(?:raised|failed) on rank\(s\) \[([0-9, ]*)\]")
"""How :func:`on_ranks` reads back inside an error's text."""


def on_ranks(ranks: Iterable[int]) -> str:
    """``on rank(s) [0, 2]``: how an error that every rank raises alike names the ranks where it
    arose (after ``raised`` or ``failed``). The launcher reads it back (:func:`origin_ranks`) to
    name one of those ranks as the run's root cause, not whichever rank happened to exit first."""
    return f"on rank(s) {sorted(ranks)}"


def origin_ranks(text: str) -> list[int]:
    """The ranks a text written by :func:`on_ranks` names (the first such phrase), else ``[]``."""
    m = ON_RANKS.search(text)
    return [int(r) for r in m.group(1).split(",") if r.strip()] if m else []


def per_rank(messages: Mapping[int, str]) -> str:
    """``rank -> message`` as one line, each distinct message once with its ranks (``rank 1: ...``,
    ``ranks 0, 2: ...``): a micro-batch every rank gets wrong reads once, not once per rank."""
    by_msg: dict[str, list[int]] = {}
    for r, m in sorted(messages.items()):
        by_msg.setdefault(m, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items())


def control_group(backend: str | None = None) -> dist.ProcessGroup | None:
    """Collective (every rank of the default group calls it, e.g. when an engine is built): the
    group the per-micro-step host checks use (:func:`host_max`). None (the default group) when it
    already carries CPU tensors (gloo, a ``cpu:gloo,cuda:nccl`` default, any backend but NCCL) or
    there is one rank; else (NCCL) a new gloo group over every rank, which the caller destroys when done
    (``dist.destroy_process_group(group)``). ``backend``: the default group's, read from it when
    None. Why a second group: an NCCL all-reduce read back on the host waits for every kernel
    queued before it, so a per-micro-step check there would stop the host at each forward."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    name = str(backend if backend is not None else dist.get_backend())
    if "gloo" in name or "nccl" not in name:  # gloo, cpu:gloo,cuda:nccl, or another CPU-capable backend
        return None
    return dist.new_group(backend="gloo")


CONTROL_RANGE = ranges.call_name(CommKind.CONTROL)
"""The profiler range of the engine's control all-reduces (``zeropp/control``)."""


def host_max(values: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """Collective over ``group`` (None: the default group, which must carry CPU tensors): the
    element-wise max of ``values`` (host ints, the same length on every rank) over the ranks. A
    CPU all-reduce: reading it back waits for the other ranks' hosts, never for a GPU."""
    return host_max_start(values, group)()


def host_max_start(values: list[int], group: dist.ProcessGroup | None = None) -> Callable[[], list[int]]:
    """:func:`host_max` issued without waiting: returns the call that waits for it and reads the
    result (call it exactly once, before this rank's next collective on ``group``)."""
    t = torch.tensor(values, dtype=torch.int64)  # [n] on the host
    with ranges.span(CONTROL_RANGE):
        finish = control_all_reduce(t, "max", group, async_op=True)

    def read_host_max() -> list[int]:
        finish()
        return t.tolist()

    return read_host_max


def agree_on_forward(
    error: BaseException | None, group: dist.ProcessGroup | None = None, *, defer: bool = False
) -> Callable[[], None] | None:
    """Collective over the default group's ranks (every rank calls it after its forward and loss,
    with the exception they raised or None): returns when no rank failed, else raises one
    ``RuntimeError`` on every rank naming the failed ranks and their errors (chained to this
    rank's own). One 8-byte host exchange on ``group`` (:func:`control_group`) when nothing
    failed; one process: ``error`` re-raised.

    ``defer`` (ignored when this rank's ``error`` is set): issue the all-reduce and return the
    rest of the check, which the caller must run before this rank's next collective (the module
    docstring says why); it raises there if another rank failed. None when nothing is left."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return None
    if defer and error is None:
        read = host_max_start([0], group)
        return lambda: _agree(read()[0], None, group)
    _agree(host_max([int(error is not None)], group)[0], error, group)
    return None


def _agree(failed_anywhere: int, error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """:func:`agree_on_forward` once the flags are all-reduced: raise on every rank if any failed."""
    if not failed_anywhere:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, mine, group=group)
    failed = {r: m for r, m in enumerate(msgs) if m is not None}
    what = per_rank(failed)
    raise RuntimeError(
        f"the forward or the loss raised {on_ranks(failed)}, so no rank goes on to backward "
        f"or the next collective: {what}"
    ) from error
