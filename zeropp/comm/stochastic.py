"""Seeds for stochastic rounding in the quantized collectives (an unbiased quantizer, QSDP's idea).

The rule (also in docs/design.md): a collective whose ``spec`` has ``rounding="stochastic"``
takes the next index ``call`` of a per-process counter (every such all-gather and
reduce-scatter call, in issue order, starting at 0; a plain call (``spec=None``) or
``rounding="nearest"`` takes none), and quantization round ``hop`` of that call (0: the first
quantization on this rank; 1: qgZ's re-quantization of the node's partial sums) uses the kernel seed
``stochastic_seed(seed, rank, call, hop)`` with ``seed`` the spec's base seed (``QuantSpec.seed``)
and ``rank`` the *global* rank. The mix is SplitMix64 applied in a chain and cut to 63 bits, so
every rank draws different noise, successive calls differ, and a given (seed, rank, call, hop)
always gives the same rounding.

The base seed comes from the spec (the runner sets it as ``zero.grads.seed`` /
``zero.weights.seed``, independent of ``train.seed``). The counter is a :class:`StochasticCounter`
owned by the call's communication session (``zeropp.comm.session.CommSession``): an engine or a
plug-in has its own, starting at 0, so two engines in one process never draw each other's
indices. The engine's checkpoints save every rank's value and a load restores it
(``zeropp/runtime/checkpoint.py``), so a resumed run draws the same noise as an uninterrupted one.
The module-level :func:`stochastic_calls` / :func:`reset_stochastic_calls` read and set the
counter of the default session, the one plain collective calls made without a ``session`` use.
"""

from __future__ import annotations

import operator
import threading
from typing import Optional

_M64 = (1 << 64) - 1
_SEED_LIMIT = 1 << 63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def check_base_seed(seed: Optional[int]) -> int:
    """The caller's base seed as a plain int (None -> 0); ValueError outside [0, 2**63)."""
    if seed is None:
        return 0
    try:
        value = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}") from None
    if isinstance(seed, bool) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")
    return value


def stochastic_seed(seed: Optional[int], rank: int, call: int, hop: int = 0) -> int:
    """Kernel seed of quantization round ``hop`` of stochastic call ``call`` on global ``rank``."""
    h = _splitmix64(check_base_seed(seed))
    for v in (rank, call, hop):
        h = _splitmix64(h ^ (v & _M64))
    return h & (_SEED_LIMIT - 1)


class StochasticCounter:
    """The call index of the seed rule: how many stochastic collective calls its owner issued.
    Thread-safe (the comm worker issues the DDP hook's calls)."""

    def __init__(self, value: int = 0) -> None:
        self._lock = threading.Lock()
        self._value = 0
        self.reset(value)

    @property
    def value(self) -> int:
        """How many stochastic calls were taken (= the next call's index)."""
        return self._value

    def reset(self, value: int = 0) -> None:
        """Set the counter (e.g. to replay a run from a known point, or on a checkpoint load)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the stochastic call counter must be an int >= 0, got {value!r}")
        with self._lock:
            self._value = value

    def take(self) -> int:
        """Take the next call index (the collectives call this once per stochastic call)."""
        with self._lock:
            call = self._value
            self._value += 1
            return call

    def __repr__(self) -> str:
        return f"StochasticCounter({self._value})"


DEFAULT_COUNTER = StochasticCounter()
"""The default session's counter: that of plain collective calls made without a ``session``."""


def stochastic_calls() -> int:
    """Stochastic calls made through the default session (= its next call's index); an engine's or
    a plug-in's own count is ``session.stochastic.value``."""
    return DEFAULT_COUNTER.value


def reset_stochastic_calls(value: int = 0) -> None:
    """Set the default session's call counter (plain calls without a ``session``)."""
    DEFAULT_COUNTER.reset(value)
