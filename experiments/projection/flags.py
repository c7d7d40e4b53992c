"""Argument types of the cost model's command lines (``experiments.scaling``,
``experiments.step_schedule``, ``experiments.plan``): a rate, a count or a fraction that the model
divides by or scales with is checked as argparse parses it, so a zero, a negative number, inf or
NaN is a usage error (exit 2) naming the flag, not a ``ZeroDivisionError`` or a table of NaN. Link
and compute rates must also be of a plausible size (:func:`link_rate`, :func:`compute_rate`): a rate
typed in the wrong unit (bit/s for Gbit/s, FLOP/s for TFLOP/s) is refused, not projected."""

from __future__ import annotations

import argparse
import math

__all__ = ["compute_rate", "fraction", "link_rate", "non_negative", "positive_count", "positive_rate"]

LINK_GBPS = (1e-6, 1e5)
"""Link rates a command takes, Gbit/s: 1 kbit/s to 100 Tbit/s (the cluster file's bounds,
``cluster_file.GBPS_RANGE``)."""
COMPUTE_TFLOPS = (1e-6, 1e5)
"""Achieved compute a command takes, TFLOP/s per rank: 1 MFLOP/s to 100 PFLOP/s (a GPU of 2026
reaches a few thousand)."""


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_rate(text: str) -> float:
    """A finite number > 0 (Gbit/s, TFLOP/s): the model divides by it."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


def _in_range(text: str, lo: float, hi: float, unit: str) -> float:
    value = positive_rate(text)
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give {unit} from {lo:g} to {hi:g} (a rate in another unit? 1 {unit} is 1)"
        )
    return value


def link_rate(text: str) -> float:
    """A link rate in Gbit/s within :data:`LINK_GBPS`."""
    return _in_range(text, *LINK_GBPS, "Gbit/s")


def compute_rate(text: str) -> float:
    """Achieved compute in TFLOP/s within :data:`COMPUTE_TFLOPS`."""
    return _in_range(text, *COMPUTE_TFLOPS, "TFLOP/s")


def non_negative(text: str) -> float:
    """A finite number >= 0 (a latency in seconds)."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number >= 0")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _number(text)
    if not 0 <= value <= 1:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction in [0, 1]")
    return value


def positive_count(text: str) -> int:
    """An integer >= 1 (ranks, GPUs, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value
