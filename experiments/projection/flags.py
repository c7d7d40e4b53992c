"""Argument types of the cost model's command lines (``experiments.scaling``,
``experiments.step_schedule``, ``experiments.plan``): a rate, a count or a fraction that the model
divides by or scales with is checked as argparse parses it, so a zero, a negative number, inf or
NaN is a usage error (exit 2) naming the flag, not a ``ZeroDivisionError`` or a table of NaN."""

from __future__ import annotations

import argparse
import math

__all__ = ["fraction", "non_negative", "positive_count", "positive_rate"]


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
