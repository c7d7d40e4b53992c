"""Shared plumbing of the collectives: backend calls, async handles, argument checks, wire packing.

Every check here depends only on arguments that all ranks share (sizes, dtypes, bits, the
topology, the group), so a bad call raises the same error on every rank *before* any message
is sent: no rank is left waiting in a collective that its peers never entered.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Callable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from zeropp.kernels.layout import QUANT_FLOAT_DTYPES

from . import context, lifetime
from .feedback import ErrorFeedback
from .lifetime import Buffers
from .spec import QuantSpec

if TYPE_CHECKING:
    from .chain import Deferred
    from .session import CommSession

ReduceOpLike = Union[dist.ReduceOp, "dist.ReduceOp.RedOpType"]
"""``ReduceOp.SUM`` / ``AVG`` (enum values) or a ``ReduceOp`` object such as ``PREMUL_SUM(f)``."""


# ---------------------------------------------------------------------------------- handles
class CommHandle(dist.Work):
    """Async result of a zeropp collective: ``wait()`` waits for the backend messages, then runs
    the local post-processing (dequantize, sum, later hops) that writes the output.

    Subclasses ``dist.Work`` so callers that test ``isinstance(work, dist.Work)`` (FSDP2) treat it
    as the async work it is. ``is_completed()`` is True once ``wait()`` has written the output.
    Later hops of a multi-hop collective (qgZ) do not wait for ``wait()``: they run as a
    continuation (``chain.py``) as soon as the first hop lands, in call order; ``finish`` then
    only waits for that continuation. Handles may be waited in any order.

    ``buffers`` (``lifetime.Buffers``): the wire and receive buffers the works and ``finish``
    use. They are released at the end of ``wait()``, on the stream it is called on (CUDA:
    ``record_stream`` there, so a ``wait()`` on another stream than the issuer's is safe too).

    ``session`` / ``kind``: the wait runs inside the session's wait hooks
    (``session.CommSession.waiting(kind)``), which is how waits are timed from outside.

    ``wait(timeout)`` bounds the wait as ``dist.Work.wait`` does (a ``timedelta``; zero or None:
    no bound, the process group's timeout applies): past it, the RuntimeError of the backend's
    wait (``Operation timed out!``) or of the continuation's is raised and the handle stays
    unfinished, holding its buffers (the backend may still use them), so a later ``wait()`` can
    finish it on gloo; NCCL's timed-out work keeps its error, so there a later wait raises it again.
    """

    def __init__(
        self,
        works: Sequence[Optional[Union[dist.Work, Deferred]]],
        finish: Optional[Callable[[], None]] = None,
        buffers: Optional[Buffers] = None,
        *,
        session: Optional[CommSession] = None,
        kind: str = "",
    ) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._buffers = buffers
        self._done = False
        self._session, self._kind = session, kind

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._done:
            deadline = _deadline(timeout)
            if self._session is None:
                self._wait(deadline)
            else:
                with self._session.waiting(self._kind):
                    self._wait(deadline)
        return True

    def _wait(self, deadline: Optional[float]) -> None:
        if not self._done:
            try:
                for w in self._works:
                    if deadline is None:
                        w.wait()
                    else:  # at least a millisecond: a zero timedelta means "no bound" to the backend
                        w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                self._works = []  # the backend's work objects (and the tensors they hold) can go now
                lifetime.completed()
                if self._finish is not None:
                    self._finish()
                self._finish = None
                self._done = True
            finally:
                if self._done or not self._works:  # a failed backend wait keeps them: it may still use them
                    buffers, self._buffers = self._buffers, None
                    if buffers is not None:
                        buffers.release()

    def is_completed(self) -> bool:
        return self._done


def _deadline(timeout: object) -> Optional[float]:
    """``time.monotonic()`` by which a wait given ``timeout`` must end; None: unbounded (None or a
    zero ``timedelta``, as ``dist.Work.wait`` reads it)."""
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"wait(timeout=...) takes a datetime.timedelta (as dist.Work.wait), got {timeout!r}")
    seconds = timeout.total_seconds()
    return None if seconds == 0 else time.monotonic() + seconds


def finish_or_handle(
    works: Sequence[Optional[Union[dist.Work, Deferred]]],
    finish: Optional[Callable[[], object]],
    async_op: bool,
    buffers: Optional[Buffers] = None,
    *,
    session: Optional[CommSession] = None,
    kind: str = "",
) -> Optional[CommHandle]:
    """``async_op``: return a handle that finishes on ``wait()``; otherwise finish now, return None.
    ``buffers``: the collective's own buffers, released when it finished (:class:`CommHandle`).
    ``session`` / ``kind``: whose wait hooks the wait (now or later) runs in."""
    h = CommHandle(works, finish, buffers, session=session, kind=kind)
    if async_op:
        return h
    h.wait()
    return None


# ---------------------------------------------------------------------------------- backend
# Every backend collective of zeropp.comm goes through these, and through context.issue: the
# backend's own threads may hold the tensors a moment after the call completed, and must never be
# the ones to free their Python objects (context.py says why).
#
# A group of one rank (world 1, hpZ groups of one, the cross group of a one-node topology) moves
# nothing: the collective is a local copy (or nothing, for an in-place all-reduce), made on the
# caller's current stream at issue, which is where the backend would have ordered it, and returned
# as an already finished work. Bit for bit the backend's result (a copy, a sum or max of one
# value); what it saves is the backend's per-call work (gloo's worker handoff, about 70 us a call
# on CPU; NCCL's kernel launch, events and work object).
class _LocalWork(dist.Work):
    """The finished work of a collective over a group of one rank (done at issue)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _alone(group) -> bool:
    """Whether ``group`` (None: the default group) has this rank only."""
    return dist.get_world_size(group) == 1


def _local(async_op: bool) -> Optional[dist.Work]:
    return _LocalWork() if async_op else None


_LOCAL_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def _identity_op(op) -> bool:
    """Whether reducing one value with ``op`` gives the value (not ``PREMUL_SUM``, which scales it)."""
    try:
        return any(op == o for o in _LOCAL_OPS)
    except (TypeError, RuntimeError):  # a ReduceOp object such as PREMUL_SUM(f)
        return False


def backend_all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """``all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor`` (older)."""
    if _alone(group):
        out.view(-1).copy_(inp.reshape(-1))
        return _local(async_op)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return context.current().issue(lambda: fn(out, inp, group=group, async_op=async_op), (out, inp))


def backend_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op, group, async_op: bool):
    """``reduce_scatter_single`` (torch >= 2.13) or the deprecated ``reduce_scatter_tensor``."""
    if _alone(group) and _identity_op(op):
        out.view(-1).copy_(inp.reshape(-1))
        return _local(async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return context.current().issue(lambda: fn(out, inp, op=op, group=group, async_op=async_op), (out, inp))


def backend_all_to_all(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """Equal-split all-to-all: chunk ``i`` of ``inp`` (dim 0) goes to group rank ``i``."""
    if _alone(group):
        out.view(-1).copy_(inp.reshape(-1))
        return _local(async_op)
    return context.current().issue(lambda: dist.all_to_all_single(out, inp, group=group, async_op=async_op), (out, inp))


def backend_all_reduce(tensor: torch.Tensor, op, group, async_op: bool):
    """In-place all-reduce of ``tensor``."""
    if _alone(group) and _identity_op(op):
        return _local(async_op)
    return context.current().issue(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), (tensor,))


def exchange_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device ``group``'s backend exchanges tensors on: the current CUDA device for NCCL, else
    the CPU (what a control exchange must use whatever device a rank's model is on)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_all_reduce(
    t: torch.Tensor, op: Literal["sum", "max"], group=None, *, async_op: bool = False
) -> Callable[[], None]:
    """All-reduce a few control values in place (a loss, squared norms, flags: bytes, not data)
    over ``group``, summed or maxed. Returns the call that finishes it (waits, then writes ``t``):
    already done unless ``async_op``, when the caller must call it before reading ``t``.

    Why not ``all_reduce``: on gloo a small all-reduce walks a ring, 2(W - 1) message rounds, each
    a wake-up of every rank's gloo threads; an all-to-all of the vector is one round, after which
    every rank reduces the ``W`` copies itself. With ranks sharing CPU cores that costs about half
    the CPU and half the wait of the ring (measured with 4 ranks on 2 cores: 0.6 against 1.5 ms of
    CPU per call and rank). The ranks' copies are combined in rank order, one element-wise
    operation at a time, so every rank gets the same bits on any CPU. Other backends (NCCL) and
    device tensors use ``all_reduce``, whose small-message algorithms are already one round."""
    g = group if group is not None else dist.group.WORLD
    if dist.get_rank(g) < 0:  # not a member: nothing to exchange, as all_reduce
        return lambda: None
    w = dist.get_world_size(g)
    if w == 1:
        return lambda: None
    if t.device.type != "cpu" or "gloo" not in str(dist.get_backend(g)):
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        work = backend_all_reduce(t, red, group, async_op)

        def wait() -> None:
            if work is not None:
                work.wait()

        return wait
    flat = t.view(-1)  # [n], a view of t (a non-contiguous t raises here)
    n = flat.numel()
    send = flat.repeat(w)  # [W * n]: this rank's values for every member
    recv = torch.empty_like(send)  # [W * n]: member r's values at row r
    work = backend_all_to_all(recv, send, group, True)

    done = False

    def finish() -> None:
        nonlocal done
        if done:  # a second call changes nothing
            return
        done = True
        work.wait()
        rows = recv.view(w, n)
        acc = rows[0].clone()  # [n]
        for r in range(1, w):
            if op == "sum":
                acc.add_(rows[r])
            else:
                torch.maximum(acc, rows[r], out=acc)
        flat.copy_(acc)

    if not async_op:
        finish()
        return lambda: None
    return finish


# ---------------------------------------------------------------------------------- checks
def check_spec_type(spec: object, name: str = "spec") -> Optional[QuantSpec]:
    """``spec`` must be a :class:`QuantSpec` or None (= the plain collective)."""
    if spec is not None and not isinstance(spec, QuantSpec):
        raise TypeError(
            f"{name} must be a zeropp.comm.QuantSpec or None (plain collective), got {type(spec).__name__}; "
            f"e.g. {name}=QuantSpec(bits=8)"
        )
    return spec


def check_gather_spec(spec: Optional[QuantSpec], name: str = "spec") -> Optional[QuantSpec]:
    """An all-gather has one hop and rounds nothing it could carry over: a spec asking for
    per-hop bits or error feedback would be silently ignored, so it is refused."""
    check_spec_type(spec, name)
    if spec is not None and spec.intra_bits is not None:
        raise ValueError(
            f"{name}.intra_bits={spec.intra_bits} does nothing for an all-gather (one hop); "
            f"set intra_bits=None (it applies to reduce-scatters only)"
        )
    if spec is not None and spec.error_feedback:
        raise ValueError(
            f"{name}.error_feedback=True does nothing for an all-gather (no residual is carried to a "
            f"next call); set error_feedback=False (it applies to reduce-scatters only)"
        )
    return spec


def check_reduce_spec(
    spec: Optional[QuantSpec], error_feedback: Optional[ErrorFeedback], name: str = "spec"
) -> Optional[QuantSpec]:
    """A reduce-scatter's spec and its error-feedback state must agree: the spec says *whether*
    residuals are kept (and at which width), the caller-owned :class:`ErrorFeedback` *holds* them."""
    check_spec_type(spec, name)
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError(f"error_feedback must be a zeropp.comm.ErrorFeedback, got {type(error_feedback).__name__}")
    wants = spec is not None and spec.error_feedback
    if wants and error_feedback is None:
        raise ValueError(
            f"{name}.error_feedback=True but no error_feedback state was passed; pass "
            f"error_feedback=ErrorFeedback() (owned by the caller, one per model) and a feedback_key per bucket"
        )
    if wants and error_feedback.residual_bits != spec.residual_bits:
        raise ValueError(
            f"{name}.residual_bits={spec.residual_bits} but the error_feedback state stores "
            f"{error_feedback.residual_bits}-bit residuals; build it with ErrorFeedback.for_spec({name}) "
            f"(= ErrorFeedback(residual_bits={spec.residual_bits}))"
        )
    if error_feedback is not None and not wants:
        what = "spec=None (a plain reduce-scatter rounds nothing)" if spec is None else f"{name}.error_feedback=False"
        raise ValueError(
            f"an error_feedback state was passed with {what}; set {name}=QuantSpec(..., "
            f"error_feedback=True) to use it, or pass error_feedback=None"
        )
    return spec


def check_float(t: torch.Tensor, what: str) -> None:
    if t.dtype not in QUANT_FLOAT_DTYPES:
        raise ValueError(
            f"{what} has dtype {t.dtype}; quantized collectives take float32, bfloat16 or float16 "
            f"(pass spec=None for a plain collective of other dtypes)"
        )


def check_plain_dtypes(out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
    """A plain collective sends the input's dtype and converts into the output's after receiving:
    between floating dtypes only (a rounding, as a quantized output's precision), since a cast
    to or from an integer or bool output would silently truncate or wrap the values (1.7 -> 1,
    -2.6 -> 254 in uint8), where ``torch.distributed`` refuses the pair."""
    if out.dtype != inp.dtype and not (out.dtype.is_floating_point and inp.dtype.is_floating_point):
        raise ValueError(
            f"{what} output has dtype {out.dtype} but its input {inp.dtype}; a plain collective converts between "
            f"floating dtypes only: allocate the output as {inp.dtype}"
        )


def check_contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(t.stride())}); pass t.contiguous()")


def check_rows(t: torch.Tensor, W: int, n: int, spec: Optional[QuantSpec], what: str, written: bool = False) -> None:
    """A collective's ``[W * n]`` side must be contiguous; a quantized one may also be a ``[W, n]``
    view whose rows are each contiguous and a fixed stride apart (the kernels index it in place).
    A ``written`` side's rows must not overlap (a row stride of at least ``n``; an ``expand``-ed
    or ``as_strided`` view would have each member's row overwrite the others'): refused here,
    before any message, rather than by the kernel after the gather."""
    if t.is_contiguous():
        return
    rows_ok = t.dim() == 2 and tuple(t.shape) == (W, n) and (n <= 1 or t.stride(1) == 1)
    if spec is not None and rows_ok and (not written or W <= 1 or t.stride(0) >= n):
        return
    hint = f" or, quantized, a [{W}, {n}] view with contiguous rows" if spec is not None else ""
    raise ValueError(
        f"{what} must be contiguous{hint} (got shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
        "pass t.contiguous()"
    )


def check_member(ranks: list[int], what: str) -> None:
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of the {what} group {ranks}; only members may call it")


def check_op_dtype(op_name: str, t: torch.Tensor, what: str) -> None:
    """An average of an integer tensor on gloo (the backend of CPU tensors) has no place to put its
    fraction: gloo fails it only after the exchange, with ``result type Float can't be cast to the
    desired output type Long``. Refused here, alike on every rank, before any message. NCCL (a CUDA
    tensor) averages integers itself (``ncclAvg``, rounding as integer division), so that AVG is
    left to it; a bool AVG and an integer PREMUL_SUM (its scaling) are refused on every backend,
    as NCCL refuses them too, in torch's words."""
    if op_name not in ("avg", "premul_sum") or t.is_floating_point() or t.is_complex():
        return
    if op_name == "avg" and t.dtype != torch.bool and t.device.type != "cpu":
        return  # NCCL's integer average
    why = (
        " (gloo, the backend of CPU tensors, cannot average integers; NCCL can)"
        if op_name == "avg" and t.dtype != torch.bool
        else ""
    )
    raise ValueError(
        f"{what} with ReduceOp.{op_name.upper()} of a {t.dtype} tensor: its mean is not a {t.dtype}{why}; "
        f"reduce with ReduceOp.SUM and divide, or pass a floating-point tensor"
    )


def parse_op(op: ReduceOpLike) -> tuple[str, float]:
    """ReduceOp -> ("sum" | "avg" | "premul_sum" | other name, factor). PREMUL_SUM carries its factor."""
    code = op.op if isinstance(op, dist.ReduceOp) and hasattr(op, "op") and op.op is not None else op
    if code == dist.ReduceOp.SUM:
        return "sum", 1.0
    if code == dist.ReduceOp.AVG:
        return "avg", 1.0
    if code == dist.ReduceOp.PREMUL_SUM:
        f = op.factor
        return "premul_sum", float(f.item() if isinstance(f, torch.Tensor) else f)
    return str(code).split(".")[-1].lower(), 1.0
