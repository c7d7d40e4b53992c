"""Error-feedback state of the quantized reduce-scatter: an object the caller owns.

``QuantSpec.error_feedback`` says whether residuals are kept and ``QuantSpec.residual_bits`` how
they are stored; an :class:`ErrorFeedback` holds them, one per model (or per FSDP module / DDP
state), keyed by gradient bucket and hop. The state stays outside the spec so that the spec
remains a value (hashable, shareable across models and logs).

Which residual each rank keeps (qgZ, ``qgz.py``): every quantization round of a reduce-scatter
is compensated by the rank that performs it.

- hop 1 (every reduce-scatter; the only hop of the flat single all-to-all): the rank quantizes
  its own input ``x = gradient + r1``; ``r1 = x - dq(q(x))``, ``[W * n]`` in input chunk order,
  under the caller's ``feedback_key``.
- hop 2 (hierarchical qgZ only): the rank re-quantizes the node's partial sums of the ``nodes``
  chunks owned by ranks with its local index, ``p = sum_of_received + r2``;
  ``r2 = p - dq(q(p))``, ``[nodes, n]`` (``[nodes, rotated n]`` for a Hadamard spec, whose sums
  live in the rotated basis), under ``feedback_key + HOP2_SUFFIX``. No other rank quantizes
  those partial sums, so each rank's ``r2`` is the whole of what that round lost, and adding it
  to the next round sends it later: the sum over all calls reaches its owner with only the last
  round's error outstanding, on both hops.

Storage (``residual_bits``): 32 keeps fp32 residuals (4 bytes per element); 8, the default,
keeps them as LoCo does, block-quantized to INT8 with one fp32 scale per ``group_size`` elements
(``zeropp.kernels.quantize``, round to nearest), about 1 byte per element, dequantized when added
to the next gradient. What the 8-bit storage itself rounds away (at most half a step of the
residual's own scale) is dropped, as in LoCo.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from zeropp.kernels import DEFAULT_GRAD_GROUP_SIZE, QuantizedTensor, dequantize, quantize

RESIDUAL_BITS = (8, 32)
"""Storage widths of a residual: 8 (INT8 codes + fp32 scales) or 32 (fp32)."""

HOP2_SUFFIX = "@hop2"
"""Appended to a bucket's ``feedback_key`` for the residual of qgZ's second hop."""

_FIELDS = ("fp32", "codes", "scales", "layout")
"""State-dict field names: ``<key>|fp32`` or ``<key>|codes`` + ``<key>|scales`` + ``<key>|layout``."""

_Stored = Union[torch.Tensor, QuantizedTensor]


def check_residual_bits(bits: object, what: str = "residual_bits") -> int:
    """``bits`` must be 8 or 32 (an int); returns it."""
    if isinstance(bits, bool) or bits not in RESIDUAL_BITS:
        raise ValueError(
            f"{what}={bits!r}: error-feedback residuals are stored in 8 bits (LoCo: INT8 codes and "
            f"one fp32 scale per group) or 32 bits (fp32); use one of {RESIDUAL_BITS}"
        )
    return int(bits)  # type: ignore[arg-type]


class ErrorFeedback:
    """Error feedback (the LoCo / EF-SGD idea) for the quantized reduce-scatter.

    Per bucket ``key`` (and per hop, see the module docstring) it holds the residual of the
    quantization this rank performed, ``r = x - dequantize(quantize(x))``, and hands it back,
    as fp32, to be added to that bucket's next value before quantizing. What one step rounds
    away is sent in a later step, so the quantization error does not accumulate in the weights.
    A non-finite element leaves a zero residual, so a skipped overflow step does not poison later
    ones.

    ``residual_bits=8`` (default) stores each residual as INT8 codes with one fp32 scale per
    ``group_size`` elements (:meth:`nbytes` is about ``numel * (1 + 4 / group_size)``);
    ``residual_bits=32`` stores fp32 (``4 * numel``). Use :meth:`for_spec` to match a spec.
    """

    def __init__(self, residual_bits: int = 8, group_size: int = DEFAULT_GRAD_GROUP_SIZE) -> None:
        self.residual_bits = check_residual_bits(residual_bits)
        """Storage width of every residual: 8 (INT8 + scales) or 32 (fp32)."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(
                f"ErrorFeedback group_size={group_size!r} must be a positive int (elements per fp32 "
                f"scale of an 8-bit residual), e.g. {DEFAULT_GRAD_GROUP_SIZE}"
            )
        self.group_size = group_size
        """Elements per fp32 scale of an 8-bit residual (unused at 32 bits)."""
        self._residuals: dict[str, _Stored] = {}

    @classmethod
    def for_spec(cls, spec: object) -> ErrorFeedback:
        """The state for reduce-scatters quantized by ``spec`` (its ``residual_bits``)."""
        return cls(residual_bits=getattr(spec, "residual_bits", 8))

    def residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of bucket ``key`` ([numel]; zeros the first time). Read-only: at 32
        bits it is the stored tensor itself."""
        r = self._residuals.get(key)
        if r is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        held = r.cols if isinstance(r, QuantizedTensor) else r.numel()
        if held != numel:
            raise ValueError(
                f"error-feedback bucket {key!r} holds {held} elements but this call has {numel}; "
                f"use one feedback_key per gradient bucket (or reset({key!r}))"
            )
        if isinstance(r, QuantizedTensor):
            return dequantize(r, dtype=torch.float32).view(-1).to(device)  # [numel]
        return r.to(device)

    def store(self, key: str, residual: torch.Tensor) -> None:
        """Keep ``residual`` (any shape and float dtype; non-finite elements become 0) for ``key``."""
        r = torch.nan_to_num(residual.reshape(-1).float(), nan=0.0, posinf=0.0, neginf=0.0)  # [numel] fp32
        if self.residual_bits == 32:
            self._residuals[key] = r  # nan_to_num made a new tensor: never aliases the caller's
        else:
            self._residuals[key] = quantize(r, 8, self.group_size, rows=1)  # codes [1, rb], scales [1, groups]

    def reset(self, key: Optional[str] = None) -> None:
        """Forget one bucket's residual, or all (e.g. when a checkpoint carries none)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._residuals)

    def nbytes(self) -> int:
        """Bytes the stored residuals occupy (codes and scales for 8 bits, fp32 otherwise)."""
        total = 0
        for r in self._residuals.values():
            if isinstance(r, QuantizedTensor):
                total += r.codes.numel() * r.codes.element_size() + r.scales.numel() * 4
            else:
                total += r.numel() * 4
        return total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors, for checkpoints: ``<key>|fp32`` ([numel]) for a 32-bit residual;
        ``<key>|codes`` (int8 [row_bytes]), ``<key>|scales`` (fp32 [groups]) and ``<key>|layout``
        (int64 [2]: numel, group size) for an 8-bit one. The tensors are the stored ones (no copy)."""
        sd: dict[str, torch.Tensor] = {}
        for key, r in self._residuals.items():
            if isinstance(r, QuantizedTensor):
                sd[f"{key}|codes"] = r.codes.view(-1)
                sd[f"{key}|scales"] = r.scales.view(-1)
                sd[f"{key}|layout"] = torch.tensor([r.cols, r.group_size], dtype=torch.int64)
            else:
                sd[f"{key}|fp32"] = r
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Replace every residual by those of ``sd`` (a :meth:`state_dict`, possibly saved at the
        other width: it is converted, an fp32 residual quantized, an 8-bit one dequantized).
        Validates everything before changing anything."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in sd.items():
            key, sep, fld = name.rpartition("|")
            if not sep or fld not in _FIELDS:
                raise ValueError(
                    f"error-feedback state entry {name!r} is not '<bucket>|<field>' with field in {_FIELDS}"
                )
            parts.setdefault(key, {})[fld] = t
        loaded: dict[str, _Stored] = {}
        for key, p in parts.items():
            if set(p) == {"fp32"}:
                value: _Stored = p["fp32"].reshape(-1).float().clone()
            elif set(p) == {"codes", "scales", "layout"}:
                numel, gs = (int(v) for v in p["layout"].reshape(-1).tolist())
                value = QuantizedTensor(
                    p["codes"].reshape(1, -1).to(torch.int8).clone(),
                    p["scales"].reshape(1, -1).float().clone(),
                    numel,
                    8,
                    gs,
                )
            else:
                raise ValueError(
                    f"error-feedback bucket {key!r} has fields {sorted(p)}; expected ['fp32'] or "
                    f"['codes', 'layout', 'scales']"
                )
            loaded[key] = _convert(value, self.residual_bits, self.group_size)
        self._residuals = loaded


def _convert(r: _Stored, bits: int, group_size: int) -> _Stored:
    """A stored residual at ``bits`` (and ``group_size`` for 8 bits)."""
    if isinstance(r, QuantizedTensor):
        if bits == 8 and r.group_size == group_size:
            return r
        r = dequantize(r, dtype=torch.float32).view(-1)
    return r if bits == 32 else quantize(r, 8, group_size, rows=1)


__all__ = ["HOP2_SUFFIX", "RESIDUAL_BITS", "ErrorFeedback", "check_residual_bits"]
