"""The convergence suite's configuration: which schemes and seeds, and each run's overrides.

:class:`SuiteConfig` parses the command line of ``python -m experiments.converge`` (``schemes=``,
``seeds=``, ``out=`` and any runner override) and :data:`SCHEMES` names the schemes; the suite
validates every run's config up front (``experiments.runner.compose.compose_run``, the runner's
own composition), so a bad override is refused before the first run. :class:`RunResult` is what one run gives back.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from zeropp.comm.spec import RECIPES

from ..runner.config import SEED_LIMIT, ConfigError

SCHEMES: dict[str, tuple[str, ...]] = {
    "fp": ("quant=none",),
    "zeropp": ("quant=zeropp",),
    "w4g4": ("quant=w4g4",),
    "w4g4_ef": ("quant=w4g4", "zero.grads.error_feedback=true"),
    "w4g4h": ("quant=w4g4h",),
    "w4g4h_ef": ("quant=w4g4h", "zero.grads.error_feedback=true"),
    "mxfp4_h": ("quant=mxfp4", "zero.grads.rotation=hadamard"),
    "mxfp4_ef": ("quant=mxfp4", "zero.grads.error_feedback=true"),
    "mxfp4_h_ef": ("quant=mxfp4", "zero.grads.rotation=hadamard", "zero.grads.error_feedback=true"),
    "nvfp4_h": ("quant=nvfp4", "zero.grads.rotation=hadamard"),
    "nvfp4_ef": ("quant=nvfp4", "zero.grads.error_feedback=true"),
    "nvfp4_h_ef": ("quant=nvfp4", "zero.grads.rotation=hadamard", "zero.grads.error_feedback=true"),
    "sdp4bit": ("quant=sdp4bit",),
}
"""Scheme name -> the runner overrides that select it (``_h``: Hadamard-rotated gradients, ``_ef``:
gradient error feedback, on top of the named recipe). Any other ``quant=`` recipe name
(``zeropp.comm.spec.RECIPES``) is accepted as a scheme too, meaning ``quant=<name>``."""


BASELINE = "fp"
"""The scheme every gap is measured against (it must be among the schemes)."""


DEFAULT_SCHEMES: tuple[str, ...] = ("fp", "zeropp", "w4g4", "w4g4_ef", "w4g4h", "sdp4bit")
"""The schemes of a bare ``python -m experiments.converge``: the INT recipes of ZeRO++ and SDP4Bit."""


DEFAULT_SEEDS: tuple[int, ...] = (0, 1)


SUITE_DEFAULTS: tuple[str, ...] = (
    "model=small",
    "topology=2x2",
    "data=text",
    "train.steps=400",
    "train.micro_batch_size=8",
    "train.eval_every=50",
    "train.eval_batches=8",
    "logger=none",
    "launcher.progress=false",
)
"""Runner overrides of the default suite: GPT ``small`` (0.83M params), 4 gloo ranks as 2 nodes
x 2, 400 steps of 4 x 8 x 64 tokens (0.82M tokens per run, ~100 s each on 2 CPU cores). Each
evaluation reads 8 held-out batches per rank (256 sequences, 16K tokens): one batch alone made
fp's eval loss differ by 3.5% between seeds, more than the gaps the suite is to measure. An
override of the same key on the command line replaces one of these."""


SUITE_KEYS = ("schemes", "seeds", "out")
"""The suite's own keys; every other ``key=value`` goes to each run."""


RESERVED = {"quant": "schemes=", "train.seed": "seeds=", "hydra.run.dir": "out=", "resume": "a fresh out="}
"""Runner keys the suite sets itself -> what to pass instead."""


MAX_SEEDS = 100
"""Most seeds per scheme: every seed is a full training run of every scheme (about 100 s each with
the defaults), so a larger count is a typo rather than a plan (and ``seeds=100000000`` would build
its list before anything else)."""


Runner = Callable[[list[str], Path], dict[str, Any]]
"""``(overrides, run_dir) -> summary``: :func:`experiments.runner.run.run_job`'s signature."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """What the suite runs: every (scheme, seed) pair with the same runner overrides."""

    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    """Scheme names (:data:`SCHEMES` or a ``quant=`` recipe); must include ``fp``."""
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    """``train.seed`` of each run of each scheme; at least two, so there is a spread."""
    out: Path = Path("outputs/converge")
    """Output directory (table, plot, ``runs/``)."""
    overrides: tuple[str, ...] = SUITE_DEFAULTS
    """Runner overrides shared by every run (suite defaults merged with the command line's)."""

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ConfigError("invalid config: schemes is empty; name at least fp and one scheme, e.g. schemes=fp,w4g4")
        dup = sorted({s for s in self.schemes if self.schemes.count(s) > 1})
        if dup:
            raise ConfigError(
                f"invalid config: schemes={','.join(self.schemes)} repeats {', '.join(dup)}; name each once"
            )
        for s in self.schemes:
            scheme_overrides(s)  # unknown name / missing recipe
        if BASELINE not in self.schemes:
            raise ConfigError(
                f"invalid config: schemes={','.join(self.schemes)} lacks {BASELINE}; the gaps are "
                f"measured against it, add it (schemes={BASELINE},{','.join(self.schemes)})"
            )
        if len(self.seeds) < 2:
            raise ConfigError(
                f"invalid config: seeds={','.join(map(str, self.seeds))} gives {len(self.seeds)} seed; "
                "the spread across seeds needs at least 2 (seeds=2, or a list seeds=0,1)"
            )
        if len(set(self.seeds)) != len(self.seeds) or any(not 0 <= s < SEED_LIMIT for s in self.seeds):
            raise ConfigError(
                f"invalid config: seeds={','.join(map(str, self.seeds))}; give distinct seeds in [0, 2**32) "
                "(train.seed's range)"
            )
        if len(self.seeds) > MAX_SEEDS:
            raise ConfigError(
                f"invalid config: seeds= gives {len(self.seeds)} seeds, {len(self.seeds) * len(self.schemes)} "
                f"training runs; the suite takes at most {MAX_SEEDS} seeds per scheme: give fewer"
            )
        for o in self.overrides:
            key = _key(o)
            for r, instead in RESERVED.items():
                if key == r or key.startswith(r + "."):
                    raise ConfigError(f"invalid config: {o!r} is set by the suite for each run; use {instead} instead")

    @classmethod
    def from_args(cls, argv: Sequence[str], *, now: str | None = None) -> SuiteConfig:
        """Parse ``key=value`` arguments: the suite's keys (:data:`SUITE_KEYS`), the rest runner
        overrides merged over :data:`SUITE_DEFAULTS` (same key: the command line wins)."""
        kw: dict[str, Any] = {}
        extra: list[str] = []
        for a in argv:
            if "=" not in a or a.startswith("-"):
                raise ConfigError(
                    f"invalid argument {a!r}: the suite takes key=value arguments only "
                    f"(its keys {', '.join(SUITE_KEYS)}, or any runner override); see --help"
                )
            key, value = a.split("=", 1)
            if key == "schemes":
                kw["schemes"] = tuple(s.strip() for s in value.split(",") if s.strip())
            elif key == "seeds":
                kw["seeds"] = _parse_seeds(value)
            elif key == "out":
                if not value.strip():  # Path("") is the current directory: the runs would land there
                    raise ConfigError("invalid config: out= is empty; name the output directory (out=outputs/conv)")
                kw["out"] = Path(value)
            else:
                extra.append(a)
        if "out" not in kw:
            kw["out"] = Path("outputs/converge") / (now or time.strftime("%Y-%m-%d_%H-%M-%S"))
        return cls(overrides=merge_overrides(SUITE_DEFAULTS, extra), **kw)

    def run_overrides(self, scheme: str, seed: int) -> list[str]:
        """The runner overrides of one run."""
        return [*self.overrides, *scheme_overrides(scheme), f"train.seed={seed}"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _parse_seeds(value: str) -> tuple[int, ...]:
    """``3`` -> (0, 1, 2); ``0,1,5`` -> (0, 1, 5)."""
    try:
        parts = [int(p) for p in value.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(
            f"invalid config: seeds={value!r}; give a count (seeds=2) or a list of integers (seeds=0,1,5)"
        ) from None
    if len(parts) == 1 and "," not in value:
        if parts[0] < 2:
            raise ConfigError(
                f"invalid config: seeds={value}; the spread across seeds needs at least 2 "
                "(a count seeds=2, or a list seeds=0,1)"
            )
        if parts[0] > MAX_SEEDS:
            raise ConfigError(
                f"invalid config: seeds={value} asks for {parts[0]} training runs per scheme; the suite takes "
                f"at most {MAX_SEEDS} seeds (a count seeds=3, or a list seeds=0,1,5)"
            )
        return tuple(range(parts[0]))
    return tuple(parts)


def merge_overrides(base: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """``base`` with each key that ``extra`` sets replaced, then ``extra``'s in its order."""
    keys = {_key(o) for o in extra}
    return (*[o for o in base if _key(o) not in keys], *extra)


def scheme_overrides(name: str) -> tuple[str, ...]:
    """The runner overrides of scheme ``name``; ConfigError naming it when it does not exist
    or its ``quant=`` recipe is missing from this checkout's ``RECIPES``."""
    ov = SCHEMES.get(name) or ((f"quant={name}",) if name in RECIPES else None)
    if ov is None:
        raise ConfigError(
            f"invalid config: unknown scheme {name!r}; schemes: {', '.join(SCHEMES)}, or any quant= "
            f"recipe ({', '.join(sorted(RECIPES))})"
        )
    recipe = next(o.split("=", 1)[1] for o in ov if o.startswith("quant="))
    if recipe not in RECIPES:
        raise ConfigError(
            f"invalid config: scheme {name!r} needs the quant recipe {recipe!r}, which this checkout "
            f"does not have (zeropp.comm.spec.RECIPES: {', '.join(sorted(RECIPES))}); leave it out, "
            f"e.g. schemes={','.join(s for s in SCHEMES if s != name and _recipe_exists(s))}"
        )
    return ov


def _recipe_exists(scheme: str) -> bool:
    return all(o.split("=", 1)[1] in RECIPES for o in SCHEMES[scheme] if o.startswith("quant="))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (scheme, seed) run: its summary, or the error that stopped it."""

    scheme: str
    """Scheme name."""
    seed: int
    """``train.seed``."""
    run_dir: Path
    """The run's directory."""
    summary: dict[str, Any] | None = None
    """The run's summary.json (None when it failed)."""
    error: str | None = None
    """Why it failed (None when it finished)."""
