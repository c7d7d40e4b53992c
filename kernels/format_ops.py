"""Dispatching fp8 / MX / NVFP4 quantize and dequantize (the formats of ``format_layout.py``).

Each public function picks an implementation per call and forwards its arguments unchanged:

- CPU tensors (``impl`` None or ``"torch"``): ``kernels/cpu_formats.py``'s function of the same
  name when that module imports and defines it, else the reference (``format_reference.py``,
  the same name with ``_ref``);
- CUDA tensors, or ``impl="triton"``: ``kernels/triton_formats.py``'s function when available,
  else the reference;
- ``impl="reference"``: always the reference (the tests' specification).

Every implementation is bit-identical with the reference, so which one ran never changes a result.
The fast modules are looked up lazily and once: a module that is absent is skipped; a module that
exists but fails to import raises (a broken kernel is an error, never a silent slow path).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from . import format_reference
from .format_layout import FormatTensor

IMPLS = (None, "torch", "triton", "reference")
"""``impl`` values: None = by device, ``torch`` = the CPU path, ``triton`` = the Triton kernels,
``reference`` = the pure-torch specification."""

_FAST_MODULES = {"torch": "cpu_formats", "triton": "triton_formats"}
_loaded: dict[str, Optional[ModuleType]] = {}


def _fast_module(kind: str) -> Optional[ModuleType]:
    """The fast module for ``kind`` (``torch`` / ``triton``), None when it does not exist."""
    if kind not in _loaded:
        name = f"{__package__}.{_FAST_MODULES[kind]}"
        try:
            _loaded[kind] = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # the module exists but one of its own imports is missing
            _loaded[kind] = None
    return _loaded[kind]


def implementation(name: str, device: torch.device, impl: Optional[str] = None) -> Callable[..., Any]:
    """The function that runs ``name`` (e.g. ``"quantize_mx"``) for data on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "reference":
        kind = impl if impl is not None else ("triton" if device.type == "cuda" else "torch")
        mod = _fast_module(kind)
        fn = getattr(mod, name, None) if mod is not None else None
        if fn is not None:
            return fn
    return getattr(format_reference, f"{name}_ref")


def quantize_fp8(
    x: torch.Tensor,
    elem: str,
    group_size: int,
    *,
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    impl: Optional[str] = None,
) -> FormatTensor:
    """fp8 (E4M3 / E5M2, an fp32 scale per group): see ``format_reference.quantize_fp8_ref``."""
    fn = implementation("quantize_fp8", x.device, impl)
    return fn(x, elem, group_size, rows=rows, stochastic=stochastic, seed=seed)


def quantize_mx(
    x: torch.Tensor,
    elem: str,
    *,
    scale_rule: str = "ocp",
    rows: int = 1,
    stochastic: bool = False,
    seed: int = 0,
    impl: Optional[str] = None,
) -> FormatTensor:
    """MX (blocks of 32, E8M0 scales): see ``format_reference.quantize_mx_ref``."""
    fn = implementation("quantize_mx", x.device, impl)
    return fn(x, elem, scale_rule=scale_rule, rows=rows, stochastic=stochastic, seed=seed)


def quantize_nvfp4(
    x: torch.Tensor, *, rows: int = 1, stochastic: bool = False, seed: int = 0, impl: Optional[str] = None
) -> FormatTensor:
    """NVFP4 (E2M1, E4M3 scale per 16, fp32 per row): see ``format_reference.quantize_nvfp4_ref``."""
    fn = implementation("quantize_nvfp4", x.device, impl)
    return fn(x, rows=rows, stochastic=stochastic, seed=seed)


def dequantize_format(
    q: FormatTensor,
    *,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Any scheme's FormatTensor ``[rows, *]`` -> ``[rows, cols]`` (``dequantize_<scheme>``)."""
    fn = implementation(f"dequantize_{q.scheme}", q.codes.device, impl)
    return fn(q, out=out, dtype=dtype)
