"""Test cases drawn from the codec registry: one spec per registered scheme and code width, so a
codec registered in ``zeropp.comm.codecs`` is covered by every test that uses them, with no edit
there. The int scheme is one case like any other."""

from __future__ import annotations

from typing import Optional

from zeropp.comm.codecs import codecs
from zeropp.comm.spec import QuantSpec, fixed_group_size, schemes


def registry_specs(group_size: Optional[int] = 32, **kw: object) -> list[QuantSpec]:
    """One spec per registered scheme (with a codec) x each of its widths, format fields at their
    defaults. ``group_size`` applies where the format does not fix it (mx: 32, nvfp4: 16)."""
    runnable = codecs()
    out = []
    for scheme, widths in sorted(schemes().items()):
        if scheme not in runnable:
            continue
        gs = None if fixed_group_size(scheme) else group_size
        out.extend(QuantSpec(scheme=scheme, bits=b, group_size=gs, **kw) for b in widths)  # type: ignore[arg-type]
    return out


def two_hop_specs(group_size: Optional[int] = 32, **kw: object) -> list[QuantSpec]:
    """Per registered scheme, a qgZ spec with its widest width inside the node and its narrowest
    across (int 8/4, mx 8/4: MXFP8 inside, MXFP4 across), or its one width on both hops."""
    out = []
    for spec in registry_specs(group_size, **kw):
        widths = schemes()[spec.scheme]
        if spec.bits == min(widths):
            out.append(spec.replace(intra_bits=max(widths)) if len(widths) > 1 else spec)
    return out


def format_variants() -> list[QuantSpec]:
    """The non-default element and scale-rule choices of the built-in float schemes."""
    return [
        QuantSpec(scheme="fp8", bits=8, group_size=32, fp8_format="e5m2"),
        QuantSpec(scheme="mx", bits=8, fp8_format="e5m2"),
        QuantSpec(scheme="mx", bits=6, fp6_format="e3m2"),
        QuantSpec(scheme="mx", bits=4, mx_scale="round_up"),
        QuantSpec(scheme="mxint", bits=8, mx_scale="round_up"),
    ]


def spec_id(spec: QuantSpec) -> str:
    return spec.label
