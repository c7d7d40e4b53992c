"""Terminal output of a run: a one-line text progress bar (rank 0) and the final summary table.

Plain text, no dependency: on a terminal the bar redraws in place; in a log file (not a tty) it
prints a line every ~10% so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    """``[#####-----] 12/30 loss 2.31 | 0.41 s/step | 8.1k tok/s | eta 7s``."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.t0 = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def update(self, step: int, *, loss: float, step_time: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        filled = int(self.width * frac)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step, 1) * (self.total - step)
        line = (f"[{'#' * filled}{'-' * (self.width - filled)}] {step}/{self.total} loss {loss:.3f} | "
                f"{step_time:.3f} s/step | {tokens_per_s / 1e3:.1f}k tok/s | eta {eta:.0f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step >= self.total else ""))
        else:
            decile = int(frac * 10)
            if decile == self._last_decile and step < self.total:
                return
            self._last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()


def summary_table(s: dict[str, Any]) -> str:
    """The end-of-run table printed to the terminal."""
    comm = s["comm_bytes_per_step"]
    mem = s["memory_per_rank"]
    rows: list[tuple[str, str]] = [
        ("run", s["label"]),
        ("device / backend", f"{s['device']} / {s['backend']}"),
        ("params", f"{s['model']['params'] / 1e6:.3f} M"),
        ("steps (measured)", f"{s['steps']} ({s['measured_steps']})"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
        ("step time", f"{s['step_time_s']['mean'] * 1e3:.1f} ms (median {s['step_time_s']['median'] * 1e3:.1f})"),
        ("model TFLOP/s", f"{s['model_tflops']:.4f} ({s['model_tflops_per_rank']:.4f} per rank)"),
        ("wire bytes / step / rank", f"{human_bytes(comm['total'])}: intra {human_bytes(comm['by_link']['intra'])}, "
                                     f"cross {human_bytes(comm['by_link']['cross'])}  "
                                     "(all torch.distributed calls)"),
    ]
    for k, v in sorted(comm["by_kind_link"].items()):
        rows.append((f"  {k}", human_bytes(v)))
    eng = s.get("engine_comm_bytes_per_step")
    if eng:
        rows.append(("zeropp kinds / step / rank",
                     f"{human_bytes(eng['total'])}: intra {human_bytes(eng['by_link']['intra'])}, "
                     f"cross {human_bytes(eng['by_link']['cross'])}  (zeropp CommStats, by purpose)"))
        for k, v in sorted(eng["by_kind_link"].items()):
            rows.append((f"  {k}", human_bytes(v)))
    frac = s.get("comm_wait_fraction")
    rows.append(("comm wait / step", f"{s['comm_wait_s_per_step'] * 1e3:.1f} ms"
                 + (f" ({100 * frac:.0f}% of step)" if isinstance(frac, float) and frac == frac else "")
                 + "  (blocked in torch.distributed)"))
    ew = s.get("engine_comm_wait_s_per_step")
    if ew is not None:
        rows.append(("engine comm wait / step", f"{ew * 1e3:.1f} ms  (engine: waits + quantize)"))
    rows.append(("model state / rank", ", ".join(human_bytes(m.get("total", 0)) for m in mem)))
    loss = s["loss"]
    ev = loss.get("eval")
    rows.append(("loss", f"{loss['first']:.3f} -> {loss['final']:.3f}" + (f" (eval {ev:.3f})" if ev is not None else "")))
    for n in s.get("notes", []):
        rows.append(("note", n))
    rows.append(("outputs", s["run_dir"]))
    w = max(len(k) for k, _ in rows)
    bar = "-" * (w + 2 + max(len(v) for _, v in rows))
    return "\n".join([bar, *(f"{k.ljust(w)}  {v}" for k, v in rows), bar])
