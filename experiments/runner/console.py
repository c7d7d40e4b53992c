"""Terminal output of a run (rank 0): a progress bar while training and the summary table after.

Both through ``rich``: on a terminal the bar redraws in place; when the output is a file or a
pipe (CI, ``ranks/`` logs, a sweep's job), rich prints nothing transient, so this module then
writes a plain line every ~10% of the steps instead, which keeps logs short and readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    """``━━━━━━━━╸━━━━━ 12/30 loss 2.310 | 0.41 s/step | 8.1k tok/s | 0:00:07`` (rank 0 only)."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.enabled = total, enabled
        self.console = Console(file=stream or sys.stderr)
        self.live = enabled and self.console.is_terminal
        self._last_decile = -1
        self.t0 = time.perf_counter()
        self.start = start
        self._bar: RichProgress | None = None
        if self.live:
            self._bar = RichProgress(
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, *, loss: float, step_time: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        info = f"loss {loss:.3f} | {step_time:.3f} s/step | {tokens_per_s / 1e3:.1f}k tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            if step >= self.total:
                self.close()
            return
        decile = int(10 * step / max(self.total, 1))
        if decile != self._last_decile or step >= self.total:
            self._last_decile = decile
            done = step - self.start
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
            self.console.print(Text(f"step {step}/{self.total} {info} | eta {eta:.0f}s"))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def transport_rows(transport: dict[str, str]) -> list[tuple[str, str]]:
    """The summary's ``zero.transport`` row: as requested, as resolved and why (none without one)."""
    if not transport:
        return []
    asked, used, why = transport.get("requested"), transport.get("resolved"), transport.get("reason")
    return [("zero.transport", f"{asked}" + (f" -> {used}" if used != asked else "") + (f" ({why})" if why else ""))]


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The (name, value) rows of the end-of-run table."""
    comm = s["comm_bytes_per_step"]
    mem = s["memory_per_rank"]
    transport = s.get("transport") or {}
    rows: list[tuple[str, str]] = [
        ("run", s["label"]),
        ("device / backend", f"{s['device']} / {s['backend']}"),
        *transport_rows(transport),
        ("params", f"{s['model']['params'] / 1e6:.3f} M"),
        ("steps (measured)", f"{s['first_step']}-{s['first_step'] + s['steps'] - 1} ({s['measured_steps']})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
        ("step time", f"{s['step_time_s']['mean'] * 1e3:.1f} ms (median {s['step_time_s']['median'] * 1e3:.1f})"),
        ("model TFLOP/s", f"{s['model_tflops']:.4f} ({s['model_tflops_per_rank']:.4f} per rank)"),
        (
            "wire bytes / step / rank",
            f"{human_bytes(comm['total'])}: intra {human_bytes(comm['by_link']['intra'])}, "
            f"cross {human_bytes(comm['by_link']['cross'])} (all torch.distributed calls)",
        ),
    ]
    if transport.get("resolved") == "shm":  # the gathers and reductions are not torch.distributed calls
        rows.append(("  (shared memory)", "the ZeRO group's plain data moves through shared memory: see zeropp kinds"))
    rows += [(f"  {k}", human_bytes(v)) for k, v in sorted(comm["by_kind_link"].items())]
    eng = s.get("engine_comm_bytes_per_step")
    if eng:
        rows.append(
            (
                "zeropp kinds / step / rank",
                f"{human_bytes(eng['total'])}: intra {human_bytes(eng['by_link']['intra'])}, "
                f"cross {human_bytes(eng['by_link']['cross'])} (zeropp CommStats, by purpose)",
            )
        )
        rows += [(f"  {k}", human_bytes(v)) for k, v in sorted(eng["by_kind_link"].items())]
    frac = s.get("comm_wait_fraction")
    rows.append(
        (
            "comm wait / step",
            f"{s['comm_wait_s_per_step'] * 1e3:.1f} ms"
            + (f" ({100 * frac:.0f}% of step)" if isinstance(frac, float) and frac == frac else "")
            + " (blocked in torch.distributed)",
        )
    )
    ew = s.get("engine_comm_wait_s_per_step")
    if ew is not None:
        rows.append(("engine comm wait / step", f"{ew * 1e3:.1f} ms (engine: waits + quantize)"))
    rows.append(("model state / rank", ", ".join(human_bytes(m.get("total", 0)) for m in mem)))
    rows += memory_rows(s)
    loss = s["loss"]
    ev = loss.get("eval")
    rows.append(
        ("loss", f"{loss['first']:.3f} -> {loss['final']:.3f}" + (f" (eval {ev:.3f})" if ev is not None else ""))
    )
    if s.get("checkpoint"):
        rows.append(("checkpoint", s["checkpoint"]))
    rows.append(("outputs", s["run_dir"]))
    return rows


_SHORT = {"params": "p", "grads": "g", "optimizer": "o", "activations": "a", "buffers": "b"}


def memory_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Per phase, the rank holding the most: bytes per tier, the device's split by category, the
    phase's peak; then ZeRO's formula for the config by tier (``summary['memory_expected']``)."""
    phases = [ph for ph in s.get("memory_by_phase") or [] if ph]
    if not phases:
        return []
    rows: list[tuple[str, str]] = [
        (
            "memory by phase",
            "per tier, the rank with the most device bytes (p params, g grads, o optimizer, a activations, b buffers)",
        )
    ]
    for name in phases[0]:
        snaps = [(r, ph[name]) for r, ph in enumerate(phases) if name in ph]
        r, top = max(snaps, key=lambda x: x[1]["tier_totals"]["device"])
        dev = top["tiers"]["device"]
        split = " ".join(f"{_SHORT[c]} {human_bytes(v)}" for c, v in dev.items() if v)
        tt = top["tier_totals"]
        peak = max(p["peak"] for _, p in snaps)
        rss = max(p.get("process", {}).get("rss", 0) for _, p in snaps)
        rows.append(
            (
                f"  {name} (rank {r})",
                f"device {human_bytes(tt['device'])} [{split}] | host "
                f"{human_bytes(tt['host'])} | disk {human_bytes(tt['disk'])} | peak {human_bytes(peak)} "
                f"({top['peak_source']}) | rss {human_bytes(rss)}",
            )
        )
    exp = s.get("memory_expected")
    if exp:
        rows.append(
            (
                "  ZeRO formula / rank",
                " | ".join(f"{t} {human_bytes(sum(c.values()))}" for t, c in exp.items())
                + " (params + grads + optimizer)",
            )
        )
    return rows


def print_summary(s: dict[str, Any], stream: TextIO | None = None) -> None:
    """The end-of-run table (a rich table; plain aligned text when not on a terminal)."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for k, v in summary_rows(s):
        table.add_row(Text(k), Text(v))  # Text: labels like "qwZ[int8]" are not rich markup
    console = Console(file=stream or sys.stdout)
    if not console.is_terminal:
        console.width = 160  # a log file: keep each row on one line
    console.print(table)
