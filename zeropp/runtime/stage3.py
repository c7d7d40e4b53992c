"""Stage 3: gather each block's parameters just before it runs, free them right after.

Consecutive blocks coalesced into one unit (``ZeroConfig.coalesce_numel``) share one hook index:
their unit is gathered at the first block's pre-hook and freed after the last block's forward; in
backward it is gathered when the gradient reaches the first of their outputs (the last block's)
and reduce-scattered once the whole unit has its gradient.

Forward: a pre-hook on the block makes sure its gather is done (waiting on a prefetch, or
gathering now) and issues the gathers of the next ``prefetch_depth`` blocks; a post-hook frees
the block (keeping the hpZ secondary slice first) and wraps the block's output in
:class:`_PreBackward`, an identity whose backward runs when the gradient reaches that output,
i.e. just before the block's own backward: it gathers the block again (inside the node when hpZ
holds a secondary copy) and prefetches the blocks that come next in backward order. The
gradient side (reduce-scatter when the last parameter of a block has its gradient, then free)
lives in ``reduction.py`` because stage 2 shares it.

The root unit (embeddings, final norm, head: everything outside the blocks) is used at both
ends of the network, so it is gathered when the model's forward starts, freed when it returns,
and gathered again (hpZ: inside the node) when the gradient reaches the model's outputs; it
stays until its last gradient (the embeddings') is reduced.

Frozen parameters (``frozen.py``): a block's (or the root's) frozen unit is gathered and freed
together with its trainable unit, and a block with frozen parameters only is gathered like any
other block. In backward a block's frozen unit is freed when the backward of the block before it
starts (it has no gradient to wait for); the root's at the end of backward. Every parameter is therefore
gathered twice per micro-step, as in ZeRO-3's 3M accounting, unless ``ZeroConfig.keep_at_turn``
keeps the root and the last block's unit gathered from the end of forward into backward. Under ``torch.no_grad()`` nothing
is wrapped and no secondary copy is made, so evaluation needs no gradient bookkeeping.

Activation checkpointing (``activations.checkpoint_blocks``) replaces a block's ``forward`` by a
non-reentrant ``torch.utils.checkpoint`` of it, *inside* these module hooks: the hooks run once
in forward (gather, free after the block), the recomputation replays only the block's own
forward, and it is triggered by the first saved tensor the block's backward needs, which comes
after :class:`_PreBackward` has re-gathered the block (from the hpZ secondary copy when there is
one) and issued the next prefetches. The re-gathered block is freed as without checkpointing,
by the engine once the block's gradient is reduced, so the reduce-scatter order is unchanged.

Gather buffers come from the engine's constant :class:`~.buffers.BufferPool` and go back to it
when a block is freed. That is safe because nothing keeps a view of a freed buffer: the
engine's ``ActivationStore`` saves parameters (and views of them, such as ``linear``'s
``weight.t()``) by reference to the ``Parameter``, re-deriving the view from the re-gathered
buffer in backward.

Blocks a rank skips: the forward gathers are issued in block order whatever the model runs (a
block's pre-hook first issues the gathers of any earlier block not gathered yet in this forward,
and the end of forward those of the blocks after the last one run), so every rank issues the
same gathers. In training, :meth:`Stage3Hooks.check_forward` then compares, with one small
all-reduce, which blocks ran on each rank, how often and in which order, and whether the forward
(or the loss) raised on some rank; if the ranks differ, every rank raises the same
``RuntimeError`` naming the blocks (or the failing ranks and their errors) before any backward
collective (whose order would otherwise differ between the ranks and hang or mix up buffers). A
rank whose forward raised first issues the forward gathers the others issued, so the all-reduce
pairs up. The usual cause of such an error is a block using a parameter registered in another
block: only the running block's (and the root's) parameters are present, the others are empty.

How a unit is gathered (its shard over the world, hpZ's secondary copy inside the node, qwZ's
kept wire rows, MixZ++'s quantized frozen rows) and freed, and when hpZ's secondaries are made
(after a training forward) is :class:`~.gathers.UnitGathers`' business (``gathers.py``).

Outputs: a block's (and the model's) output may be any nest of tuples, lists, dicts and
dataclass-like containers that ``torch.utils._pytree`` can flatten; every tensor in it that
requires grad goes through one :class:`_PreBackward`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import frozen as fz
from .batch import host_max, host_max_start, on_ranks, per_rank
from .buffers import BufferPool
from .collectives import EngineComm
from .config import ZeroConfig
from .gathers import GATHERED, UnitGathers
from .partition import FlatUnit
from .weight_diff import WeightDiff

ROOT = -1  # hook index of the root unit


class _PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, tells the engine block ``index`` is about to run backward."""

    @staticmethod
    def forward(ctx: Any, hooks: Stage3Hooks, index: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.index = hooks, index
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks.pre_backward(ctx.index)
        return (None, None, *grads)


def _dtype_error(error: BaseException) -> bool:
    """Whether ``error`` is torch's complaint about mixed dtypes (inputs in another dtype than the
    engine's compute dtype), never caused by an empty (gathered-elsewhere) parameter."""
    text = str(error)
    return "dtype" in text or "scalar type" in text


class Stage3Hooks:
    """Installs and runs the gather/free hooks of one engine.

    It gets what it uses and nothing more: the model and its block units, the communication door,
    the config (prefetch depth, bucket size, qwZ spec, hpZ), the compute dtype and device,
    ``on_block_backward(unit)``, which the engine uses to send the gradient reduce-scatters that
    must precede that block's backward gathers, and ``control``, the host group of the
    after-forward check (``batch.control_group``).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[nn.Module, FlatUnit]],
        root: FlatUnit | None,
        all_units: Sequence[FlatUnit],
        comm: EngineComm,
        *,
        config: ZeroConfig,
        dtype: torch.dtype,
        device: torch.device,
        on_block_backward: Callable[[FlatUnit], None],
        pool: BufferPool | None = None,
        weight_diff: WeightDiff | None = None,
        frozen: fz.FrozenUnits | None = None,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        self.frozen = frozen if frozen is not None else fz.FrozenUnits(order=[blk for blk, _ in blocks])
        trained = {id(blk): u for blk, u in blocks}
        frozen_of = {id(blk): u for blk, u in self.frozen.blocks}
        order = [blk for blk in self.frozen.order if id(blk) in trained or id(blk) in frozen_of]
        self.groups: list[list[FlatUnit]] = []
        """Per hook index (a block, or consecutive blocks coalesced into one unit): the units gathered
        together, trainable first, then frozen."""
        members: list[list[nn.Module]] = []  # per hook index: its block modules, in forward order
        for blk in order:
            g = [u for u in (trained.get(id(blk)), frozen_of.get(id(blk))) if u is not None]
            if self.groups and len(g) == len(self.groups[-1]) and all(a is b for a, b in zip(g, self.groups[-1])):
                members[-1].append(blk)  # coalesced with the block before (ZeroConfig.coalesce_numel)
            else:
                self.groups.append(g)
                members.append([blk])
        self.root_group = [u for u in (root, self.frozen.root) if u is not None]
        """The root's units (trainable, frozen)."""
        self.units: list[FlatUnit] = [g[0] for g in self.groups]  # per block: its first unit (names, flushes)
        self._frozen_after = [
            [u for g in self.groups[i + 1 :] for u in g if u.kind == "frozen"] for i in range(len(self.groups))
        ]
        """Per block: the frozen units of the blocks after it, in block order (:meth:`pre_backward` frees them)."""
        self.root = root
        self.all_units = list(all_units)
        self.comm, self.cfg, self.dtype, self.device = comm, config, dtype, device
        self.on_block_backward = on_block_backward
        self.gathers = UnitGathers(
            comm,
            config=config,
            pool=pool if pool is not None else BufferPool(dtype, device),
            weight_diff=weight_diff,
            frozen_spec=self.frozen.spec,
        )
        """Gathers and frees the units, keeps hpZ's secondaries (``gathers.py``); its pool is the
        engine's constant one."""
        self.control = control
        """The group of :meth:`check_forward`'s host exchange (``batch.control_group``; None: the default group)."""
        self.depth = config.prefetch_depth
        self.ran = [0] * len(self.units)  # per block: how many times its forward ran in the current forward
        self.first = [-1] * len(self.units)  # per block: its place in the current forward's run order
        self._runs = 0  # block forwards run so far in the current forward
        self._last = -1  # the block that ran last in the current forward
        self.disorder: str | None = None  # the first block that ran after a later one, in the current forward
        self.current: int | None = None  # the block whose forward is running
        self.training_forward = False
        """Set by the engine while its training forward runs (``train_step``): only then do the units
        ``ZeroConfig.keep_at_turn`` names stay gathered for the backward that follows."""
        self._started = False  # the current training forward reached the model's pre-hook
        self._next_fwd = 0  # blocks before this index have had their forward gather issued
        m = model
        self.handles = [m.register_forward_pre_hook(self._root_pre), m.register_forward_hook(self._root_post)]
        for i, ms in enumerate(members):  # a coalesced unit is freed after its last block's forward
            for k, blk in enumerate(ms):
                self.handles.append(blk.register_forward_pre_hook(partial(self._pre, i)))
                self.handles.append(blk.register_forward_hook(partial(self._post, i, last=k == len(ms) - 1)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ gather / free (gathers.py)
    def ensure_ready(self, u: FlatUnit, *, backward: bool) -> None:
        """Make ``u``'s full parameters available in the module (waits for its gather)."""
        self.gathers.ensure_ready(u, backward=backward)

    def release(self, u: FlatUnit) -> None:
        """Free ``u``'s full buffer (waiting first if a prefetch is still writing into it)."""
        self.gathers.release(u)

    def release_all(self) -> None:
        self._started = False  # (a forward that reaches release_all is over)
        for u in self.all_units:
            if u.kind in GATHERED:
                self.release(u)

    # ------------------------------------------------------------------ hooks
    def _group(self, i: int) -> list[FlatUnit]:
        return self.root_group if i == ROOT else self.groups[i]

    def _unit(self, i: int) -> FlatUnit | None:
        """Block ``i``'s (or the root's) first unit: the trainable one, else the frozen one."""
        g = self._group(i)
        return g[0] if g else None

    def _catch_up(self, end: int) -> None:
        """Issue the forward gathers of blocks ``< end`` not issued yet, in block order, so that a
        rank that skips a block still issues the same gathers as the ranks that run it."""
        for j in range(self._next_fwd, end):
            for u in self.groups[j]:
                self.gathers.gather(u, backward=False)
        self._next_fwd = max(self._next_fwd, end)

    def _abort_forward(self) -> None:
        """This rank's forward raised: issue the forward gathers the other ranks issued (the root's,
        then every block's, in block order, as a completed forward does), so collectives pair up."""
        if not self._started:  # raised before the model's pre-hook: nothing was issued this forward
            self._root_pre(None, ())
        self._catch_up(len(self.units))

    def check_forward(self, error: BaseException | None = None, *, defer: bool = False) -> Callable[[], None] | None:
        """Collective (training only): raise on every rank unless every rank ran the same blocks,
        as often and in the same order, and no rank's forward raised (``error``: this rank's).

        ``defer`` (ignored when ``error`` is set): issue the host exchange and return the rest of
        the check, to be run before this rank's next collective (``batch.py`` says why); it raises
        there as it would here. None when nothing is left to run."""
        if error is not None:
            self._abort_forward()
        self._started = False
        world = dist.get_world_size()  # every rank (tp peers too): the reports below use the default group
        if world == 1 and error is not None:  # nobody to tell: the model's own error, as without the engine
            self.current = None
            self.release_all()
            raise error
        vec = [*self.ran, *self.first, int(self.disorder is not None), int(error is not None)]
        msg = None
        if error is not None:
            where = f" inside {self.units[self.current].name}" if self.current is not None else ""
            msg = f"{type(error).__name__}{where}: {error}"
        # this forward's report, taken now (a deferred verdict runs after backward's recomputation may
        # have counted blocks again); last: whether this rank's error could be a block using another
        # block's parameter: a torch op's error (not a micro-batch the model's forward cannot take, which fails
        # before any block runs, nor the loss's own check or a dtype mismatch: an empty parameter has the right dtype)
        mine = (
            list(self.ran),
            list(self.first),
            msg,
            self.disorder,
            isinstance(error, (RuntimeError, IndexError)) and not _dtype_error(error),
        )
        both = vec + [-v for v in vec]  # per entry: the max over ranks, and -min, once exchanged
        if world == 1:
            self._verdict(vec, both, mine, error)
            return None
        # host ints on the host group: the host does not wait for the GPU's forward
        if defer and error is None:
            read = host_max_start(both, self.control)
            return lambda: self._verdict(vec, read(), mine, None)
        self._verdict(vec, host_max(both, self.control), mine, error)
        return None

    def _verdict(self, vec: list[int], both: list[int], mine: tuple, error: BaseException | None) -> None:
        """:meth:`check_forward` once ``both`` (max, then -min, of ``vec`` over the ranks) is known."""
        n, world = len(self.units), dist.get_world_size()
        hi, lo = both[: len(vec)], [-v for v in both[len(vec) :]]
        if hi == lo and hi[-1] == 0 and hi[-2] == 0:  # the same blocks, counts and order everywhere, in
            return  # the policy's order, and no rank failed
        runs: list = [mine] * world
        if world > 1:
            dist.all_gather_object(runs, mine, group=self.control)
        self.current = None
        self.release_all()  # every rank issued the same gathers: waiting on them cannot hang
        failed = {r: run[2] for r, run in enumerate(runs) if run[2] is not None}
        if failed:
            what = per_rank(failed)
            hint = (
                ""
                if not any(run[4] for run in runs)
                else (
                    ". At stage 3 only the running block's own parameters and the root's are present (the other blocks' "
                    "are empty tensors): a parameter registered in one block and used inside another fails like this; "
                    "register it in the block that uses it (a parameter registered in two blocks is kept whole in the "
                    "root unit)"
                )
            )
            exc = RuntimeError(
                f"the forward or the loss raised {on_ranks(failed)}, so no rank runs backward: {what}{hint}"
            )
            raise exc from error
        bad = [i for i in range(n) if hi[i] != lo[i] and lo[i] == 0]
        if not bad and hi[: 2 * n] == lo[: 2 * n]:  # the same everywhere, but not in the policy's order
            what = "; ".join(f"rank {r}: {run[3]}" for r, run in enumerate(runs) if run[3] is not None)
            raise RuntimeError(
                f"ZeRO stage 3 needs the blocks to run in forward in the order the block policy lists them "
                f"(registration order: {', '.join(u.name for u in self.units)}; a block may run again right after "
                f"itself): {what}. "
                f"The gradient of a block run out of order would arrive after its unit was reduced. Register the "
                f"blocks in forward order, choose other blocks (ZeroEngine(blocks=...)), or use stage 2"
            )
        if not bad:
            what = "; ".join(
                f"{self.units[i].name} ran {sorted({runs[r][0][i] for r in range(world)})} times at places "
                f"{[runs[r][1][i] for r in range(world)]} on ranks {list(range(world))}"
                for i in range(n)
                if hi[i] != lo[i] or hi[n + i] != lo[n + i]
            )
            raise RuntimeError(
                f"ZeRO stage 3 needs every rank to run the same blocks, as often and in the same order, in each "
                f"forward: {what}. Their gradient reduce-scatters and backward gathers would be issued in different "
                f"orders on different ranks. Make the forward's block order independent of the rank's data, or use "
                f"stage 2"
            )
        what = "; ".join(
            f"{self.units[i].name} ran on ranks {[r for r in range(len(runs)) if runs[r][0][i]]} but not on "
            f"{[r for r in range(len(runs)) if not runs[r][0][i]]}"
            for i in bad
        )
        raise RuntimeError(
            f"ZeRO stage 3 needs every rank to run the same blocks in each forward: {what}. Their gradient "
            f"reduce-scatters and backward gathers would be issued in different orders on different ranks. Make "
            f"the forward run every block on every rank (e.g. multiply a block's output by a 0/1 gate instead of "
            f"skipping it), or use stage 2, which handles rank-dependent unused parameters (at stage 3 frozen "
            f"parameters are sharded and gathered too, so freezing a block does not make skipping it safe)"
        )

    def _root_pre(self, module: torch.nn.Module | None, args: Any) -> None:
        self.ran = [0] * len(self.units)
        self.first = [-1] * len(self.units)
        self._runs, self.current, self._started = 0, None, True
        self._last, self.disorder = -1, None
        self._next_fwd = 0
        self._ready_after_prefetch(self.root_group, range(0, self.depth), backward=False)

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        self._catch_up(len(self.units))
        if not self.root_group:
            return output
        return self._post(ROOT, module, args, output)

    def _pre(self, i: int, module: torch.nn.Module, args: Any) -> None:
        if not self.ran[i]:
            self.first[i] = self._runs
        self.ran[i] += 1
        self._runs += 1
        if i < self._last and self.disorder is None:
            self.disorder = f"{self.units[i].name} ran after {self.units[self._last].name}"
        self._last = i
        self.current = i
        self._catch_up(i)
        self._next_fwd = max(self._next_fwd, i + 1)
        self._ready_after_prefetch(self.groups[i], range(i + 1, i + 1 + self.depth), backward=False)

    def _post(self, i: int, module: torch.nn.Module, args: Any, output: Any, *, last: bool = True) -> Any:
        """After a block's (the root's) forward: free its units when it is the last block of its unit
        (``last``), then wrap its output so that its backward re-gathers them (every block of a
        coalesced unit wraps its own output: a gradient that reaches an inner block first, through a
        skip connection, still finds the unit gathered)."""
        if i != ROOT:
            self.current = None
        u = self._unit(i)
        grad = torch.is_grad_enabled()
        keep = grad and self._kept_at_turn(i)
        for v in (self._group(i)[1:] + [u]) if last else []:  # the block's frozen unit (if any), then its first unit
            if grad:
                self.gathers.keep_secondary(v)  # (kept units too: a later micro-step's gathers read it)
            if not keep:
                self.release(v)
        if not grad:
            return output
        if isinstance(output, torch.Tensor):
            return _PreBackward.apply(self, i, output)[0] if output.requires_grad else output
        leaves, spec = pytree.tree_flatten(output)
        idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            if i != ROOT and output is not None and not any(isinstance(t, torch.Tensor) for t in leaves):
                raise TypeError(
                    f"stage 3 must see the tensors a block returns to re-gather it for backward, but "
                    f"{self.units[i].name} returned a {type(output).__name__}, which torch.utils._pytree cannot "
                    f"flatten; return tensors in tuples, lists, dicts or a registered pytree node"
                )
            return output  # the root: the engine gathers it before backward (before_backward)
        wrapped = _PreBackward.apply(self, i, *(leaves[k] for k in idx))
        for k, t in zip(idx, wrapped):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, spec)

    def _kept_at_turn(self, i: int) -> bool:
        """Whether hook index ``i`` stays gathered after this forward (``ZeroConfig.keep_at_turn``):
        the root and the last block's unit, which backward gathers first, in the engine's
        training forward only (evaluation and a forward outside ``train_step`` free as usual)."""
        return self.cfg.keep_at_turn and self.training_forward and i in (ROOT, len(self.units) - 1)

    def before_backward(self) -> None:
        """Training, just before ``loss.backward()``: gather the root (and prefetch the last blocks),
        as the model output's :class:`_PreBackward` would; needed when the loss does not flow through
        an output tensor the forward hook could wrap. Idempotent with that hook."""
        if self.root_group:
            self.pre_backward(ROOT)

    def pre_backward(self, i: int) -> None:
        """Block ``i`` (or the root) is about to run backward: gather it, prefetch what comes next."""
        if i != ROOT:
            self.on_block_backward(self.units[i])  # blocks after i are done: send what waits
            for u in self._frozen_after[i]:  # their frozen units have no gradient to wait for: free them
                self.release(u)
        start = len(self.units) - 1 if i == ROOT else i - 1
        self._ready_after_prefetch(self._group(i), range(start, start - self.depth, -1), backward=True)

    def _ready_after_prefetch(self, group: list[FlatUnit], ahead: range, *, backward: bool) -> None:
        """Make ``group`` ready after issuing its gathers and those of the blocks ``ahead``
        (``UnitGathers.ready_after_prefetch``)."""
        self.gathers.ready_after_prefetch(
            group, [self.groups[j] for j in ahead if 0 <= j < len(self.units)], backward=backward
        )
