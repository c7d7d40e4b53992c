"""The collectives debug mode: every rank of a group must make the same call, checked.

The contract of every public collective (``collectives.py``): each rank of the group passes the
same element count, the same spec (codec, bits, group size, intra bits, ...), the same op and,
unquantized, the same dtype. A call that breaks it is *not* always caught by the backend: the
quantized wire rows are padded to whole groups of the codec, so a rank with 1000 elements and one
with 1024 send rows of equal size, and the transport pairs them without complaint while the
result is silently wrong (zeros where a shard ran out, a shard cut short, another rank's codes
read at the wrong width). ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` cannot see it either: it compares
the wire tensors' shapes, which match.

Checking always would cost a collective per call (about 1 ms of CPU per rank on gloo, every step
of the engine and the plug-ins; under NCCL also a host read, so a wait for the GPU), so it is a
debug mode: ``ZEROPP_DEBUG_COLLECTIVES=1`` (read once
per process, ``context.py``) or ``CommSession(check_collectives=True)``. Then each public call
runs its argument checks inside :func:`agreed`, which afterwards exchanges a small JSON
:func:`fingerprint` of the call (which collective, element count, spec fields, op, dtype,
topology, the group's ranks, and the local check's error if any) among the group's ranks
(``objects.all_gather_json``), and every rank compares the same gathered list with
:func:`disagreement`: a difference is the same ValueError on every rank, naming each rank's value
and what to change, raised before any data collective.

Why it cannot hang or mispair collectives:

- the exchange runs on the call's own group, on the calling thread, synchronously, right before
  the call's first data collective; so any order of data collectives that is valid without the
  mode (``chain.py``'s ordering contract) stays valid with one exchange in front of each;
- every rank of the group reaches it, whatever its arguments: a local check (ValueError or
  TypeError) that fails on some ranks only is part of the fingerprint instead of raising early
  (which would leave the others waiting in the exchange); the ranks that failed raise their own
  error, the others a ValueError naming them. Only a rank outside the group raises at once: it
  cannot take part in the group's exchange, and its peers' data collective would not pair anyway;
- the exchange's own shape does not depend on the arguments (two all-gathers: the record sizes,
  then the records padded to the longest), so mismatched calls still pair exchange with exchange;
- it has one requirement of its own: the mode is on on every rank of the group or on none (a
  launcher passes one environment to every rank; a session's explicit setting must agree too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .objects import all_gather_json
from .spec import QuantSpec
from .topology import Topology

__all__ = ["agreed", "disagreement", "dtype_name", "fingerprint", "op_name", "topology_name"]

Fingerprint = dict[str, Any]
"""One rank's description of one call: JSON values, compared key by key across the ranks."""

_HINTS = {
    "call": "call the same collective on every rank of the group, in the same order",
    "ranks": "pass the same process group on every rank",
    "n": "pass the same element count on every rank (pad every rank's tensor to the largest)",
    "spec": "pass one QuantSpec on every rank of the group",
    "gather_spec": "pass one gather_spec on every rank of the group",
    "op": "pass one reduce op on every rank of the group",
    "dtype": "pass tensors of one dtype on every rank of the group",
    "topology": "give every rank the same Topology (the session's, or set_topology)",
}


def _spec_fields(spec: Optional[QuantSpec]) -> Optional[dict[str, Any]]:
    """The spec as JSON values (None stays None: the plain collective)."""
    if spec is None or not isinstance(spec, QuantSpec):
        return None
    return {f.name: _json(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def _json(v: Any) -> Any:
    """A JSON value of ``v``: numbers, strings, booleans and None as they are, the rest as text
    (enum members, dtypes)."""
    return v if v is None or isinstance(v, (bool, int, float)) else str(v)


def fingerprint(
    call: str, ranks: list[int], n: int, *, spec: Optional[QuantSpec] = None, gather_spec: Optional[QuantSpec] = None
) -> Fingerprint:
    """What every rank of the group must agree on for ``call``: ``n`` is the call's per-rank element
    count (an all-gather's shard, a reduce-scatter's chunk, an all-reduce's tensor). The caller
    adds, once its checks computed them, ``op`` (:func:`op_name`), ``dtype`` (:func:`dtype_name`)
    where it shapes the wire (plain calls) and ``topology`` (:func:`topology_name`) where it picks
    the algorithm (the quantized reduce-scatter: one hop or qgZ's two)."""
    fp: Fingerprint = {"call": call, "ranks": list(ranks), "n": int(n), "spec": _spec_fields(spec)}
    if gather_spec is not None:
        fp["gather_spec"] = _spec_fields(gather_spec)
    return fp


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def op_name(name: str, factor: float) -> str:
    """A reduce op as ``backend.parse_op`` reads it: ``sum``, ``avg``, ``premul_sum(0.5)``."""
    return f"{name}({factor!r})" if name == "premul_sum" else name


def topology_name(topology: Topology) -> str:
    """``2x4`` (nodes x ranks per node), with ``tp=2`` when tensor-parallel."""
    t = f"{topology.nodes}x{topology.ranks_per_node}"
    return t if topology.tp == 1 else f"{t} tp={topology.tp}"


def _show(v: Any, plain: bool = True) -> str:
    """A value as the message shows it; ``plain``: None is a whole spec's (the plain collective)."""
    if isinstance(v, dict):  # a spec: its fields, all of them (each rank's whole spec)
        return "QuantSpec(" + ", ".join(f"{k}={v[k]!r}" for k in v) + ")"
    if v is None:
        return "None (plain)" if plain else "None"
    return repr(v) if isinstance(v, str) else str(v)


def _differences(key: str, values: list[Any], names: list[int]) -> list[str]:
    """``key: rank a: v0, rank b: v1, ...`` lines (``names``: the ranks as named) for a key whose
    values differ; a spec present on every rank is compared field by field."""
    if all(isinstance(v, dict) for v in values):
        fields = list(dict.fromkeys(f for v in values for f in v))
        return [
            f"{key}.{f}: " + ", ".join(f"rank {r}: {_show(v.get(f), plain=False)}" for r, v in zip(names, values))
            for f in fields
            if len({repr(v.get(f)) for v in values}) > 1
        ]
    return [f"{key}: " + ", ".join(f"rank {r}: {_show(v)}" for r, v in zip(names, values))]


def _names(prints: list[Fingerprint]) -> list[int]:
    """How the message names the ranks: their global ranks when all agree on the group (the usual
    case), else their group ranks."""
    ranks = prints[0].get("ranks")
    if isinstance(ranks, list) and len(ranks) == len(prints) and all(p.get("ranks") == ranks for p in prints):
        return [int(r) for r in ranks]
    return list(range(len(prints)))


def disagreement(prints: list[Fingerprint]) -> Optional[str]:
    """The error message for the group's gathered fingerprints (group-rank order), or None when
    all ranks made the same call. Pure and deterministic: every rank computes the same message
    from the same list."""
    names = _names(prints)
    keys = list(dict.fromkeys(k for p in prints for k in p if k != "error"))
    lines: list[str] = []
    hints: list[str] = []
    for key in keys:
        values = [p.get(key) for p in prints]
        if len({repr(v) for v in values}) > 1:
            lines += _differences(key, values, names)
            hint = _HINTS.get(key, f"pass the same {key} on every rank")
            if key == "n":
                hint = f"{hint[:-1]}, {max(int(v) for v in values if v is not None)} elements)"
            hints.append(hint)
    if not lines:
        return None
    call = prints[0].get("call", "collective")
    return (
        f"{call}: the ranks of its group ({names}) made different calls; every rank must pass the "
        f"same element count and the same spec. " + "; ".join(lines) + ". To fix: "
        f"{'; '.join(hints)} (checked by ZEROPP_DEBUG_COLLECTIVES=1)"
    )


def _refused(prints: list[Fingerprint]) -> Optional[str]:
    """The message for the ranks whose own checks passed while others' failed (None: no rank failed)."""
    failed = [(r, p["error"]) for r, p in zip(_names(prints), prints) if p.get("error")]
    if not failed:
        return None
    call = prints[0].get("call", "collective")
    named = "; ".join(f"rank {r}: {e}" for r, e in failed)
    return (
        f"{call}: other ranks of the group refused this call ({named}); fix their arguments so that "
        f"every rank makes the same valid call (checked by ZEROPP_DEBUG_COLLECTIVES=1)"
    )


@contextlib.contextmanager
def agreed(
    check: bool,
    group: Optional[dist.ProcessGroup],
    call: str,
    ranks: list[int],
    n: int,
    *,
    spec: Optional[QuantSpec] = None,
    gather_spec: Optional[QuantSpec] = None,
) -> Iterator[Fingerprint]:
    """Run a call's local argument checks (the ``with`` body, which must start no collective and
    may add fields to the yielded :func:`fingerprint`), then, when ``check`` (the session's
    ``check_collectives``), exchange the fingerprint among ``group``'s ranks and raise on every
    rank if any rank's checks failed or the calls differ (module docstring). ``check`` off: just
    the body, with a throwaway empty dict (no fingerprint is built on the hot path)."""
    if not check:
        yield {}
        return
    fp = fingerprint(call, ranks, n, spec=spec, gather_spec=gather_spec)
    try:
        yield fp
    except (ValueError, TypeError) as e:
        all_gather_json(dict(fp, error=f"{type(e).__name__}: {e}"), group)
        raise  # this rank's own error; the others raise _refused's message
    prints = all_gather_json(fp, group)
    msg = _refused(prints) or disagreement(prints)
    if msg is not None:
        raise ValueError(msg)
