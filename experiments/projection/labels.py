"""Short run labels for a sweep's tables and plots, in the words a researcher uses.

:func:`label_runs` names every run of a sweep by what sets it apart from the others, read from the
run's own resolved config (``summary.json``'s ``config``, i.e. ``RunConfig.to_dict()``): the
method (trainer, ZeRO stage, ZeRO++ quantization and hpZ, offload tiers) as ``ZeRO-1 + CPU
offload``, ``ZeRO++ (w8g4, hpZ)`` or ``FSDP2``; then precision, model and topology where they
differ; then, for any other setting that still tells runs apart, ``key=value``. What every run
shares is returned apart (``RunLabels.common``), for a figure's title, so a label carries only the
difference. Runs whose configs are the same (repeats) get ``#1``, ``#2``, ... so no two labels
are equal.

Written by hand because the words are this project's (no library knows what ``zero.hpz=true``
is called); it works on the config dicts rather than on ``RunConfig`` objects so that summaries
written by older versions still get labels, and a spec it cannot read falls back to ``key=value``.
"""

from __future__ import annotations

import dataclasses
import string
from collections import Counter
from typing import Any, Mapping, Sequence

from zeropp.comm.spec import QuantSpec

__all__ = ["RunLabels", "flatten", "label_runs", "method_words", "quant_words"]

TRAINER_WORDS = {"fsdp2": "FSDP2", "fsdp2_zeropp": "FSDP2", "ddp": "DDP", "ddp_zeropp": "DDP"}
"""Trainers other than ``zeropp``, by the name of the torch API they wrap."""
TIER_WORDS = {"cpu": "CPU", "nvme": "NVMe"}
"""Offload tiers (``zero.offload_optimizer`` / ``zero.offload_param``) as written in prose."""
QUIET_KEYS = (
    "logger.",
    "launcher.progress",
    "launcher.heartbeat_s",
    "launcher.grace_s",
    "launcher.timeout_s",
    "launcher.pg_timeout_s",
    "train.log_every",
    "train.checkpoint_dir",
    "train.keep_checkpoints",
    "resume",
)
"""Config keys (or prefixes) that do not change what a run measures: never used to tell runs apart."""
ALIASES = {"stage": "zero.stage"}
"""Top-level override keys and the config key they set."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunLabels:
    """The labels of a sweep's runs and what the runs share."""

    labels: tuple[str, ...]
    """One label per run, in the order given; all different."""
    common: str
    """What every run has in common, in the same words (``ZeRO-3, tiny model, 2x2 ranks``); empty
    when nothing is."""

    def __post_init__(self) -> None:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"RunLabels.labels must be unique, got {list(self.labels)}")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"zero": {"stage": 3}}`` -> ``{"zero.stage": 3}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _spec(d: Any) -> str:
    """A QuantSpec dict as ``INT8``, ``INT8g64``, ``MXFP8/4``, ``INT4+had+ef`` (``QuantSpec.label``,
    its format's name in capitals); ``custom`` for a dict this version cannot read."""
    try:
        spec = QuantSpec(**d)
    except (TypeError, ValueError):
        return "custom"
    label = spec.label
    name = len(label) - len(label.lstrip(string.ascii_lowercase))  # the letters before the width
    return label[:name].upper() + label[name:]


def _plain_bits(d: Any) -> int | None:
    """The bits of a spec with every other field at its default (``w8g4`` can name it), else None."""
    try:
        spec = QuantSpec(**d)
    except (TypeError, ValueError):
        return None
    return spec.bits if spec == QuantSpec(bits=spec.bits, scheme=spec.scheme) and spec.scheme == "int" else None


def quant_words(zero: Mapping[str, Any]) -> list[str]:
    """ZeRO++'s switches of a ``zero`` section: ``["w8g4", "hpZ"]``, ``["qwZ INT8"]``,
    ``["qgZ INT4+had+ef", "qWD INT4"]``; empty when nothing is quantized and hpZ is off."""
    w, g = zero.get("weights"), zero.get("grads")
    parts = []
    wb, gb = (_plain_bits(w) if w else None), (_plain_bits(g) if g else None)
    if wb is not None and gb is not None:
        parts.append(f"w{wb}g{gb}")
    else:
        parts += [f"qwZ {_spec(w)}"] if w else []
        parts += [f"qgZ {_spec(g)}"] if g else []
    parts += ["hpZ"] if zero.get("hpz") else []
    parts += [f"qWD {_spec(zero['weight_diff'])}"] if zero.get("weight_diff") else []
    return parts


def _offload_words(zero: Mapping[str, Any]) -> str:
    opt, par = zero.get("offload_optimizer", "none"), zero.get("offload_param", "none")
    o, p = TIER_WORDS.get(opt, opt), TIER_WORDS.get(par, par)
    if opt == "none" and par == "none":
        return ""
    if par == "none":
        return f"{o} offload"
    if opt == "none":
        return f"{p} param offload"
    if opt == par:
        return f"{o} offload (optimizer + params)"
    return f"{o} optimizer + {p} param offload"


def method_words(trainer: str, zero: Mapping[str, Any]) -> str:
    """The method of a run: ``ZeRO-1 + CPU offload``, ``ZeRO++ (w8g4, hpZ)``, ``ZeRO-2 + qgZ INT4``,
    ``stage 0 (replicated)``, ``FSDP2``, ``FSDP2 + ZeRO++ (w8g4)``, ``DDP + ZeRO++ (qgZ INT4)``."""
    quant = quant_words(zero)
    stage = zero.get("stage")
    if trainer in TRAINER_WORDS:
        head = TRAINER_WORDS[trainer]
        if trainer.endswith("_zeropp"):
            head += f" + ZeRO++ ({', '.join(quant)})" if quant else " + ZeRO++"
        elif quant:
            head += f" ({', '.join(quant)})"
    elif trainer == "zeropp" and stage == 3 and quant:
        head = f"ZeRO++ ({', '.join(quant)})"
    elif trainer == "zeropp":
        head = "stage 0 (replicated)" if stage == 0 else f"ZeRO-{stage}"
        head += f" + {', '.join(quant)}" if quant else ""
    else:
        head = f"trainer={trainer}"
    offload = _offload_words(zero)
    return f"{head} + {offload}" if offload else head


def _facets(summary: Mapping[str, Any]) -> dict[str, str]:
    """The named facets of one run: method, precision, model, topology."""
    c = summary.get("config") or {}
    zero, model, topo = c.get("zero") or {}, c.get("model") or {}, c.get("topology") or {}
    name = (summary.get("model") or {}).get("name") or ""
    if not name and model:
        name = model.get("hf_config") or f"d{model.get('d_model')}xL{model.get('n_layers')}"
    shape = f"{topo.get('nodes', '?')}x{topo.get('ranks_per_node', '?')} ranks"
    if (topo.get("tp") or 1) > 1:
        shape += f", TP {topo['tp']}"
    return {
        "method": method_words((c.get("trainer") or {}).get("name", summary.get("trainer", "zeropp")), zero),
        "precision": str(zero.get("precision", "fp32")),
        "model": f"{name} model" if name else "",
        "topology": shape,
    }


def _quiet(key: str) -> bool:
    return any(key == q or (q.endswith(".") and key.startswith(q)) for q in QUIET_KEYS)


def _override_keys(summary: Mapping[str, Any]) -> list[str]:
    """Config keys the run's overrides set, in the order typed (groups such as ``quant=`` are not keys)."""
    keys = []
    for o in summary.get("overrides") or []:
        k = o.split("=", 1)[0].lstrip("+~")
        keys.append(ALIASES.get(k, k))
    return keys


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return ",".join(_value(x) for x in v)
    return str(v)


def label_runs(summaries: Sequence[Mapping[str, Any]]) -> RunLabels:
    """Labels for ``summaries`` (``summary.json`` dicts: ``config``, ``model.name``, ``overrides``)
    that name only what differs between them; see the module docstring for the rules."""
    facets = [_facets(s) for s in summaries]
    differ = [f for f in ("method", "precision", "model", "topology") if len({x[f] for x in facets}) > 1]
    parts = [[x[f] for f in differ if x[f]] for x in facets]
    common = [
        facets[0][f]
        for f in ("method", "precision", "model", "topology")
        if f not in differ and facets and facets[0][f]
    ]
    flat = [flatten(s.get("config") or {}) for s in summaries]
    keys = list(dict.fromkeys([k for s in summaries for k in _override_keys(s)] + [k for f in flat for k in f]))
    for k in keys:
        if _quiet(k) or len({repr(f.get(k)) for f in flat}) < 2:
            continue
        groups: dict[tuple[str, ...], set[str]] = {}
        for p, f in zip(parts, flat):
            groups.setdefault(tuple(p), set()).add(repr(f.get(k)))
        if any(len(v) > 1 for v in groups.values()):  # runs this key tells apart share a label so far
            for p, f in zip(parts, flat):
                p.append(f"{k}={_value(f.get(k))}")
    labels = [", ".join(p) or x["method"] for p, x in zip(parts, facets)]  # alike runs: the method names them
    counts, seen = Counter(labels), Counter[str]()
    for i, lab in enumerate(labels):
        if counts[lab] > 1:
            seen[lab] += 1
            labels[i] = f"{lab} #{seen[lab]}"
    return RunLabels(labels=tuple(labels), common=", ".join(common))
