"""A calibrated cluster file: the link and kernel figures ``python -m experiments.bench_comm
--calibrate FILE`` measured, which the cost model reads instead of its hand-set constants.

What it holds (version :data:`VERSION`, plain JSON, never pickle):

* ``links``: per link class (``intra``: inside a node, ``inter``: across nodes) the latency of
  one message step ``alpha_s`` and the bandwidth ``gbps`` (Gbit/s), from a least-squares fit
  :func:`fit_alpha_beta` of the plain all-gather's time over its size sweep, ``t = a + b * B``
  with ``B`` the bus bytes of the call (nccl-tests' convention: size x (n - 1) / n, the bytes
  each rank moves over its busiest link in a ring); ``alpha_s = a / (n - 1)`` (a ring all-gather
  takes ``n - 1`` message steps, as ``scaling.link_terms`` counts them) and ``gbps = 1 / b``, the
  asymptotic bus bandwidth. The intra class is fitted on the node's own group, the inter class on
  the world (whose ring crosses every node's uplink once per step: ``Cluster.wire="ring"``).
* ``quant_rates``: GB/s of full-precision input per ``(op, format)`` of the codecs
  (``scaling.QUANT_OPS``; a format is :func:`~experiments.projection.scaling.format_name`,
  e.g. ``int8``, ``mxfp4``, ``nvfp4``; the earlier ``mx4`` / ``mx6`` / ``mx8`` are read as
  ``mxfp4`` / ``mxfp6`` / ``mxfp8``: ``scaling.FORMAT_ALIASES``), timed in the benchmark's ranks, all at once.

:func:`read_cluster_file` refuses a file that is not one (a missing key, another version, a
negative or zero bandwidth; a key nothing reads, a key given twice in one object, or two rates for
one ``(op, format)``: hand edits that would be silently dropped; a link whose ``ranks`` is not the
group its class is fitted on, ``ranks_per_node`` for ``intra`` and the world for ``inter``, or a
link class the shape has not: one node has no ``inter``) with what to change; :meth:`ClusterFile.cluster` and
:meth:`ClusterFile.link_overrides` put its figures into a :class:`~.spec.Cluster`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from zeropp.input_files import DuplicateKeyError, read_json
from zeropp.output_files import write_output_file

from .flags import LINK_GBPS
from .scaling import QUANT_OPS, canonical_format, known_formats
from .spec import Cluster

VERSION = 1
"""The file format's version; a file of another version is refused (re-run ``--calibrate``)."""

KIND = "zeropp-cluster"
"""The ``kind`` key every cluster file carries, so another JSON file is told apart at once."""

LINK_CLASSES = ("intra", "inter")
"""Link classes of a cluster file: inside a node, across nodes."""


class ClusterFileError(ValueError):
    """A cluster file that cannot be used: the message names the file, the key and the fix."""


GBPS_RANGE = LINK_GBPS
"""Link bandwidths a cluster file may hold, Gbit/s (those the commands take): 1 kbit/s to 100 Tbit/s (NVLink's bus rate is
some 4 Tbit/s). Outside, the figure is a corrupt or crafted file or a unit slip, and the cost model
would turn it into a step time of 0 or inf (a table of ``inf`` and ``nanx``, exit 0)."""
ALPHA_MAX_S = 10.0
"""Largest latency of one message step, seconds (a fabric's is microseconds; a ring's whole
start-up at 1000 nodes is well below this)."""
RATE_RANGE = (1e-6, 1e5)
"""Codec rates a cluster file may hold, GB/s of full-precision input (a GPU kernel reaches some
3000)."""


def _real(x: object) -> bool:
    """A JSON number (not a bool, which JSON keeps apart and Python counts as an int; not a string)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Latency and bandwidth of one link class, fitted on a size sweep."""

    alpha_s: float
    """Seconds per message step (the fit's intercept over the ring's ``n - 1`` steps)."""
    gbps: float
    """Bus bandwidth, Gbit/s (the inverse of the fit's slope over bus bytes)."""
    ranks: int = 2
    """Ranks of the group the sweep ran on (its ring has ``ranks - 1`` steps)."""
    points: int = 0
    """Sizes the fit used (0: set by hand)."""

    def __post_init__(self) -> None:
        if not (_real(self.alpha_s) and math.isfinite(self.alpha_s) and 0 <= self.alpha_s <= ALPHA_MAX_S):
            raise ValueError(
                f"LinkFit.alpha_s={self.alpha_s!r}; a latency is a finite number of seconds >= 0 and <= {ALPHA_MAX_S:g}"
            )
        lo, hi = GBPS_RANGE
        if not (_real(self.gbps) and math.isfinite(self.gbps) and lo <= self.gbps <= hi):
            raise ValueError(
                f"LinkFit.gbps={self.gbps!r}; a bandwidth is a finite rate > 0 Gbit/s, from {lo:g} to {hi:g}"
            )
        if not (_count(self.ranks) and _count(self.points) and self.ranks >= 2 and self.points >= 0):
            raise ValueError(
                f"LinkFit ranks={self.ranks!r}, points={self.points!r}; a link joins >= 2 ranks (whole numbers)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterFile:
    """What a cluster file holds (see the module doc)."""

    nodes: int
    """Nodes of the world that was measured."""
    ranks_per_node: int
    """Ranks per node of that world."""
    backend: str
    """Process-group backend the collectives ran on (``gloo``, ``nccl``)."""
    links: dict[str, LinkFit]
    """Per link class of :data:`LINK_CLASSES` present in the world (one node: ``intra`` only)."""
    quant_rates: tuple[tuple[str, str, float], ...] = ()
    """``(op, format, GB/s of full-precision input)`` per codec kernel op timed."""
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form provenance (command, host, date); not read by the model."""

    def __post_init__(self) -> None:
        if not (_count(self.nodes) and _count(self.ranks_per_node) and self.nodes >= 1 and self.ranks_per_node >= 1):
            raise ValueError(
                f"ClusterFile nodes={self.nodes!r}, ranks_per_node={self.ranks_per_node!r}; use whole numbers >= 1"
            )
        if not isinstance(self.backend, str):
            raise ValueError(f"ClusterFile.backend={self.backend!r}; name the backend (gloo, nccl)")
        unknown = set(self.links) - set(LINK_CLASSES)
        if unknown or not self.links:
            raise ValueError(f"ClusterFile.links={sorted(self.links)}; give one or more of {LINK_CLASSES}")
        self._check_link_ranks()
        timed = [(op, fmt) for op, fmt, _ in self.quant_rates]
        twice = sorted({k for k in timed if timed.count(k) > 1}, key=str)
        if twice:  # the model would take the last one, the other silently dropped
            raise ValueError(
                f"ClusterFile.quant_rates gives (op, format) {twice[0]!r} more than once, and the model would read "
                "only the last; keep one rate per (op, format)"
            )
        for op, fmt, gbs in self.quant_rates:
            lo, hi = RATE_RANGE
            if not (isinstance(op, str) and isinstance(fmt, str) and _real(gbs) and math.isfinite(gbs)):
                raise ValueError(f"ClusterFile.quant_rates entry {(op, fmt, gbs)!r}; a rate is (op, format, GB/s > 0)")
            if op not in QUANT_OPS or fmt not in known_formats():  # a rate never looked up would be ignored
                raise ValueError(
                    f"ClusterFile.quant_rates entry {(op, fmt, gbs)!r}; the op is one of {', '.join(QUANT_OPS)} "
                    f"and the format one of {', '.join(sorted(known_formats()))}"
                )
            if not lo <= gbs <= hi:
                raise ValueError(
                    f"ClusterFile.quant_rates entry {(op, fmt, gbs)!r}; a rate is (op, format, GB/s > 0), "
                    f"from {lo:g} to {hi:g} GB/s"
                )

    def _check_link_ranks(self) -> None:
        """Each link class was fitted on one group of this file's world (module doc): ``intra`` on one
        node's ranks, ``inter`` on the whole world, which spans nodes. A ``ranks`` of another group
        (a hand edit, a file of another shape pasted in) would charge its per-step latency to rings
        of another length; refused, naming the key and the value it must have."""
        world = self.nodes * self.ranks_per_node
        if "intra" in self.links and self.ranks_per_node < 2:
            raise ValueError(
                f"ClusterFile links.intra is given but ranks_per_node={self.ranks_per_node}: a node of one rank has "
                "no intra-node link; remove links.intra or give the ranks per node the sweep ran"
            )
        if "inter" in self.links and self.nodes < 2:
            raise ValueError(
                f"ClusterFile links.inter is given but nodes={self.nodes}: one node has no cross-node link; "
                "remove links.inter or give the nodes the sweep spanned"
            )
        want = {"intra": (self.ranks_per_node, "one node's ranks (ranks_per_node)"), "inter": (world, "the world")}
        for link, fit in self.links.items():
            n, group = want[link]
            if _count(fit.ranks) and fit.ranks != n:
                raise ValueError(
                    f"ClusterFile links.{link}.ranks={fit.ranks}, but the {link} link is fitted on {group}: "
                    f"{n} ranks of nodes={self.nodes} x ranks_per_node={self.ranks_per_node}; set links.{link}.ranks "
                    f"to {n} (or re-run python -m experiments.bench_comm --calibrate on this shape)"
                )

    def link_overrides(self) -> dict[str, float]:
        """The :class:`Cluster` fields this file sets: ``alpha_intra_s`` and ``intra_gbps`` from the
        intra class, ``alpha_cross_s`` and ``cross_gbps`` from the inter class (what is present)."""
        out: dict[str, float] = {}
        if "intra" in self.links:
            out.update(alpha_intra_s=self.links["intra"].alpha_s, intra_gbps=self.links["intra"].gbps)
        if "inter" in self.links:
            out.update(alpha_cross_s=self.links["inter"].alpha_s, cross_gbps=self.links["inter"].gbps)
        return out

    def cluster(self, base: Cluster) -> Cluster:
        """``base`` with this file's link figures in place of its constants."""
        return dataclasses.replace(base, **self.link_overrides())  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "version": VERSION,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "backend": self.backend,
            "links": {k: dataclasses.asdict(v) for k, v in self.links.items()},
            "quant_rates": [{"op": op, "format": fmt, "gbs": gbs} for op, fmt, gbs in self.quant_rates],
            "source": self.source,
        }


def fit_alpha_beta(bus_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``seconds = a + b * bus_bytes`` (``numpy.linalg.lstsq``); returns ``(a, b)``.
    Needs two or more distinct sizes; a fit whose slope is not positive (the sweep never left the
    latency floor) raises ValueError saying to sweep larger sizes. A slightly negative intercept
    (noise at the smallest sizes) is returned as is; callers clamp it."""
    import numpy as np

    x, y = np.asarray(bus_bytes, dtype=float), np.asarray(seconds, dtype=float)
    if x.shape != y.shape or len(set(x.tolist())) < 2:
        raise ValueError(f"a latency-bandwidth fit needs >= 2 distinct sizes, got {len(set(x.tolist()))}")
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    if not b > 0:
        raise ValueError(
            f"the time did not grow with the size (slope {b:.3g} s/byte): the sweep stayed at the latency "
            "floor; sweep larger sizes (--max-bytes)"
        )
    return float(a), float(b)


def link_fit(ranks: int, bus_bytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """:func:`fit_alpha_beta` as a :class:`LinkFit` of a ``ranks``-rank ring (module doc)."""
    a, b = fit_alpha_beta(bus_bytes, seconds)
    return LinkFit(alpha_s=max(a, 0.0) / (ranks - 1), gbps=8 / b / 1e9, ranks=ranks, points=len(bus_bytes))


def is_cluster_file(doc: object) -> bool:
    """``doc`` (parsed JSON) is a cluster file (what :func:`write_cluster_file` may replace)."""
    return isinstance(doc, dict) and doc.get("kind") == KIND


def write_cluster_file(path: str | Path, cf: ClusterFile) -> None:
    """Write ``cf`` as JSON to ``path``, atomically (a reader sees the old file or the new one): a
    new file or one this tool wrote; a file that is not a cluster file is refused rather than
    overwritten."""
    p = Path(path)
    if p.exists():
        try:
            ours = is_cluster_file(json.loads(p.read_text()))
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise ClusterFileError(f"{p} exists and is not a cluster file; give a new path to --calibrate")
    write_output_file(p, json.dumps(cf.to_json(), indent=1) + "\n")


FILE_KEYS = ("kind", "version", "nodes", "ranks_per_node", "backend", "links", "quant_rates", "source")
"""The keys of a cluster file (:meth:`ClusterFile.to_json`)."""
LINK_KEYS = ("alpha_s", "gbps", "ranks", "points")
"""The keys of a ``links`` entry (:class:`LinkFit`'s fields)."""
RATE_KEYS = ("op", "format", "gbs")
"""The keys of a ``quant_rates`` entry."""


def _only(d: Any, keys: Sequence[str], where: str, path: Path) -> None:
    """A key of ``d`` outside ``keys`` (a hand edit: ``"intra_gbps": 100`` beside ``links``, a typo)
    would be read by nothing: :class:`ClusterFileError` naming it and the keys there are."""
    extra = sorted(k for k in d if k not in keys) if isinstance(d, dict) else []
    if extra:
        raise ClusterFileError(
            f"{path}: {where} has the key(s) {', '.join(map(repr, extra))}, which nothing reads; the keys there "
            f"are {', '.join(keys)} (remove the others, or re-run python -m experiments.bench_comm --calibrate)"
        )


def _need(d: dict[str, Any], key: str, where: str, path: Path) -> Any:
    if key not in d:
        raise ClusterFileError(f"{path}: {where} has no {key!r}; re-run python -m experiments.bench_comm --calibrate")
    return d[key]


def read_cluster_file(path: str | Path) -> ClusterFile:
    """Read and validate a cluster file (``json.loads`` only: nothing in it runs). Raises
    :class:`ClusterFileError` for an unreadable file, another format, a missing key, another
    version or an invalid figure, naming the file and the key."""
    p = Path(path)
    try:
        d = read_json(p, unique_keys=True)  # a link or key given twice: one would be dropped unseen
    except OSError as e:
        raise ClusterFileError(f"cannot read cluster file {p}: {e.strerror or e}") from None
    except DuplicateKeyError as e:
        raise ClusterFileError(f"{p}: invalid cluster file: {e}; keep one (a link class is given once)") from None
    except ValueError as e:
        raise ClusterFileError(f"{p} is not JSON ({e}); give a file written by bench_comm --calibrate") from None
    if not isinstance(d, dict) or d.get("kind") != KIND:
        raise ClusterFileError(f"{p} is not a cluster file (no kind={KIND!r}); give one written by --calibrate")
    if _need(d, "version", "the file", p) != VERSION:
        raise ClusterFileError(
            f"{p}: cluster file version {d['version']!r}, this zeropp reads version {VERSION}; re-run --calibrate"
        )
    _only(d, FILE_KEYS, "the file", p)
    try:
        for k, v in _need(d, "links", "the file", p).items():
            _only(v, LINK_KEYS, f"links.{k}", p)
        for r in _need(d, "quant_rates", "the file", p):
            _only(r, RATE_KEYS, "a quant_rates entry", p)
        links = {
            k: LinkFit(**{f: _need(v, f, f"links.{k}", p) for f in LINK_KEYS})
            for k, v in _need(d, "links", "the file", p).items()
        }
        rates = tuple(
            (
                _need(r, "op", "a quant_rates entry", p),
                _format_key(_need(r, "format", "a quant_rates entry", p)),
                _need(r, "gbs", "a quant_rates entry", p),
            )
            for r in _need(d, "quant_rates", "the file", p)
        )
        return ClusterFile(
            nodes=_need(d, "nodes", "the file", p),
            ranks_per_node=_need(d, "ranks_per_node", "the file", p),
            backend=_need(d, "backend", "the file", p),
            links=links,
            quant_rates=rates,
            source=d.get("source") or {},
        )
    except ClusterFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ClusterFileError(f"{p}: invalid cluster file: {e}") from None


def _format_key(fmt: Any) -> Any:
    """A file's format key as :func:`~.scaling.format_name` spells it (an earlier ``mx4`` is ``mxfp4``);
    a key that is no string is left for :class:`ClusterFile` to refuse."""
    return canonical_format(fmt) if isinstance(fmt, str) else fmt


def merge_rates(
    measured: Iterable[tuple[str, int | str, float]], cf: ClusterFile | None
) -> tuple[tuple[str, int | str, float], ...]:
    """``measured`` rates with the file's ``(op, format)`` rates after them (a format key is looked
    up before a bits key, so the file's rate wins for the formats it timed)."""
    return (*measured, *(cf.quant_rates if cf else ()))
