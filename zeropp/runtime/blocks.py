"""Which modules are the blocks, and which consecutive blocks share a unit.

The blocks are the stage-3 gather units and the stage-2/3 reduction units. They are chosen by a
*policy* (:func:`find_blocks`), like FSDP's auto-wrap policy: module classes or a
``callable(name, module) -> bool``; the outermost matching modules become the blocks, and a
model whose blocks the default rule cannot find is told which ``blocks=`` to pass
(:func:`one_unit_warning`).

Coalescing (``ZeroConfig.coalesce_numel``, :func:`coalesce_spans`): consecutive blocks whose
parameters add up to at most that many elements share one unit (``block<i>-<j>``,
:func:`span_name`), so they are gathered by one all-gather and reduced by one reduce-scatter, as
DeepSpeed's stage 3 buckets parameter fetches and gradient reductions. With 4 ranks on 2 CPU cores
each collective is a scheduling rendezvous of every rank, so fewer, larger collectives are faster
there; the price is a larger gathered buffer (at most ``coalesce_numel`` elements, or one block
when a block alone is larger). Pure functions of the model's structure and sizes, so the engine's
units, the frozen units and the communication plan (``plan.build_plan``) group alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, Union

from torch import nn

if TYPE_CHECKING:
    from .partition import FlatUnit

BlockPolicy = Union[None, type, Sequence[type], Callable[[str, nn.Module], bool]]
"""How the blocks (stage-3 gather units, stage-2/3 reduction units) are chosen: ``None`` (the
default rule: ``model.blocks`` if it is a ``ModuleList``, else the longest ``ModuleList``, else, for
an ``nn.Sequential`` model, each child that has parameters), a module class or a list of them
(every instance), or ``callable(qualified_name, module) -> bool``."""


class BlockChoiceWarning(UserWarning):
    """Stage 3 would gather every trainable parameter as one unit (see :func:`one_unit_warning`)."""


def _describe(policy: BlockPolicy) -> str:
    if isinstance(policy, type):
        return policy.__name__
    if callable(policy):
        return getattr(policy, "__qualname__", None) or repr(policy)
    if policy is None:
        return "None"
    return "[" + ", ".join(getattr(c, "__name__", repr(c)) for c in policy) + "]"


def _matcher(policy: BlockPolicy) -> Callable[[str, nn.Module], bool]:
    """The policy as ``(name, module) -> bool``; a malformed policy is a ``TypeError`` naming it."""
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not classes:
            raise TypeError(
                f"blocks={_describe(policy)}: a block policy list must hold nn.Module subclasses "
                f"(not {bad or 'nothing'}); or pass callable(name, module) -> bool, or None"
            )
        return lambda name, m: isinstance(m, classes)
    if callable(policy):
        return policy
    raise TypeError(
        f"blocks={policy!r}: use None, a module class, a list of module classes, or callable(name, module) -> bool"
    )


def find_blocks(model: nn.Module, policy: BlockPolicy = None) -> list[nn.Module]:
    """The per-block units, in registration order (assumed to be forward order).

    ``policy=None``: ``model.blocks`` if it is a ``ModuleList``, else the longest ModuleList, else,
    when ``model`` is an ``nn.Sequential`` (a plain stack of layers, run in order), each child
    that has parameters (e.g. each ``Linear`` of an MLP; a parameter-free ``ReLU`` is no block);
    otherwise no blocks (everything is the root). Otherwise, like FSDP's auto-wrap policy, the
    submodules (the model itself excluded) that the policy matches, outermost only: a match inside
    another match belongs to the outer block. A policy that matches nothing is a ``ValueError``
    naming it; it depends only on the model's structure, so every rank raises it alike.
    """
    if policy is None:
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        if lists:
            longest: nn.ModuleList = max(lists, key=len)
            return list(longest)
        if isinstance(model, nn.Sequential):
            return [m for m in model.children() if next(m.parameters(), None) is not None]
        return []
    match = _matcher(policy)
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in found):
            continue  # the model itself, or inside a block already chosen
        if match(name, m):
            found.append((name, m))
    if not found:
        raise ValueError(
            f"the block policy blocks={_describe(policy)} matches no submodule of "
            f"{type(model).__name__}; pass the class of its repeated layers (e.g. the transformer "
            f"block), a callable(name, module) -> bool that selects them, or blocks=None"
        )
    return [m for _, m in found]


def coalesce_spans(sizes: Sequence[int], coalesce_numel: int) -> list[tuple[int, int]]:
    """Group consecutive blocks: ``sizes[i]`` is block ``i``'s element count; returns inclusive
    ``(first, last)`` block index ranges, in order, covering every block. Greedy from the first
    block: a block joins the running group while the group's total stays ``<= coalesce_numel``;
    a block larger than the threshold is a group of its own. ``coalesce_numel=0``: one group per
    block. Pure, so the engine's units, the frozen units and the communication plan
    (``plan.build_plan``) group alike."""
    if coalesce_numel < 0:
        raise ValueError(f"coalesce_numel must be >= 0, got {coalesce_numel}")
    spans: list[tuple[int, int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if spans and coalesce_numel and total + n <= coalesce_numel:
            spans[-1] = (spans[-1][0], i)
            total += n
        else:
            spans.append((i, i))
            total = n
    return spans


def span_name(first: int, last: int) -> str:
    """The unit name of blocks ``first..last``: ``block<i>`` for one block, ``block<i>-<j>`` for several."""
    return f"block{first}" if first == last else f"block{first}-{last}"


def one_unit_warning(
    model: nn.Module, policy: BlockPolicy, units: Sequence[FlatUnit], *, coalesce_numel: int = 0
) -> str | None:
    """The warning for a stage-3 partition whose one gathered unit holds every trainable parameter
    (``units``: what :func:`build_units` returned), else None.

    Stage 3 saves parameter memory only between gathers: with one unit the whole model is gathered
    for the forward and again for the backward, so the peak holds every parameter, as at stages 0-2.
    It happens silently with the default rule on a model without ``ModuleList`` or ``Sequential``
    structure, or with a policy that matches one module; the text names ``blocks=`` to fix it. When
    the one unit is several blocks merged by ``coalesce_numel`` (a ``block<i>-<j>`` unit), the text
    names that threshold instead."""
    gathered = [u for u in units if u.kind == "sharded"]
    if len(gathered) != 1:
        return None
    u = gathered[0]
    numel = sum(s.numel for s in u.slots)
    if "-" in u.name:  # several blocks, merged by the coalescing threshold
        return (
            f"ZeRO stage 3: coalesce_numel={coalesce_numel:,} merged every block of {type(model).__name__} into one "
            f"unit ({u.name!r}) holding all {numel:,} trainable parameters, gathered whole for the forward and for "
            f"the backward: the peak then holds every parameter, as at stages 0-2. Lower ZeroConfig.coalesce_numel "
            f"(the runner's zero.coalesce_numel) below the model's size, or set it to 0 for one unit per block"
        )
    if policy is None:
        how = (
            f"the default block rule (blocks=None: model.blocks or the longest nn.ModuleList, or the children of "
            f"an nn.Sequential model) found {'no blocks' if u.name == 'root' else 'one block'} in "
            f"{type(model).__name__}"
        )
    else:
        how = f"the block policy blocks={_describe(policy)} leaves one unit in {type(model).__name__}"
    return (
        f"ZeRO stage 3: {how}, so one unit ({u.name!r}) holds all {numel:,} trainable parameters and is "
        f"gathered whole for the forward and for the backward: the peak then holds every parameter, as at "
        f"stages 0-2. Choose the gather units with ZeroEngine(..., blocks=...): a module class or a list of "
        f"them (e.g. blocks=nn.Linear, or the class of the repeated layer), or callable(qualified_name, module) "
        f"-> bool"
    )
