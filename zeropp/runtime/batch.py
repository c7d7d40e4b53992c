"""How the engine calls a model on a micro-batch and finds the loss in what it returns.

The engine wraps any ``nn.Module``, so neither the forward's signature nor the output's form is
fixed. One rule for each, the same in ``train_step`` and ``eval_loss``:

- the call (:func:`call_model`): a micro-batch that is a ``dict`` (any ``Mapping``) is passed as
  keyword arguments, ``model(**mb)``; a ``tuple`` as positional arguments, ``model(*mb)`` (so the
  GPT's ``(idx, targets)`` works as before); anything else (a tensor, a list, an object) as the
  one argument, ``model(mb)``.
- the loss (:func:`loss_of`): ``loss_fn(output, mb)`` when the engine was given one; otherwise
  taken from the output: a scalar tensor is the loss; a mapping's ``"loss"`` entry (Hugging Face's
  ``ModelOutput`` is one); an object's ``loss`` attribute; a tuple's or list's last element (the
  GPT's ``(logits, loss)``). It must be a one-element floating tensor; anything else is a
  ``ValueError`` saying what was found and how to pass a ``loss_fn``.

And one rule for a forward that raises on some ranks only (:func:`agree_on_forward`): every rank
learns it after the forward, with one small all-reduce, and raises the same error, instead of
the healthy ranks waiting in backward's first collective until the timeout. (Stage 3 does this
inside its own after-forward check, ``Stage3Hooks.check_forward``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, micro_batch) -> scalar loss tensor``."""


def call_model(model: nn.Module, mb: Any) -> Any:
    """``model(**mb)`` for a mapping, ``model(*mb)`` for a tuple, else ``model(mb)``."""
    if isinstance(mb, Mapping):
        return model(**mb)
    if isinstance(mb, tuple):
        return model(*mb)
    return model(mb)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def loss_of(output: Any, mb: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of one micro-batch (see the module docstring for the rule)."""
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
        raise ValueError(f"no loss in {where}: the model returned no loss (call it with targets / labels in the "
                         f"micro-batch), or pass ZeroEngine(..., loss_fn=callable(output, micro_batch) -> loss)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"{where} is {_describe(loss)}, not a one-element floating loss; return a scalar loss, or "
                         f"pass ZeroEngine(..., loss_fn=callable(output, micro_batch) -> loss)")
    return loss.reshape(())


def agree_on_forward(error: BaseException | None, device: torch.device | str) -> None:
    """Collective over the default group (every rank calls it after its forward and loss, with
    the exception they raised or None): returns when no rank failed, else raises one
    ``RuntimeError`` on every rank naming the failed ranks and their errors (chained to this
    rank's own). One 4-byte all-reduce when nothing failed; one process: ``error`` re-raised."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=device)  # [1]
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    msgs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, mine)
    failed = {r: m for r, m in enumerate(msgs) if m is not None}
    what = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    raise RuntimeError(f"the forward or the loss raised on rank(s) {sorted(failed)}, so no rank goes on to backward "
                       f"or the next collective: {what}") from error
