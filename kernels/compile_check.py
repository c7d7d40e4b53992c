"""Compile every Triton kernel for an NVIDIA target without a GPU, and check the generated PTX.

    python -m zeropp.kernels.compile_check            # sm_90 (H100/H200), representative variants
    python -m zeropp.kernels.compile_check --all      # every dtype x bits x stochastic variant (and format)

Why: CPU tests run the kernels under TRITON_INTERPRET=1, which never invokes the compiler, so an
error only the compiler sees (a non-constexpr global read, a type mismatch) would first show on a
GPU. Triton ships ptxas, so the full compile runs on any Linux machine. The PTX is also checked
for the two properties bit-exactness depends on: no ``fma`` (fp contraction off) and IEEE
division without flush-to-zero; the float formats' kernels (``triton_formats.py``: one variant per
element format and code width, both MX scale rules) must also hold no flush-to-zero instruction at
all, since their encoders take subnormal scaled values and scales. Exit code 77 means "cannot
check here" (interpreter mode or no ptxas), for test runners to report as a skip.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import re
import sys

from ._triton import HAS_TRITON, LAUNCH_OPTS, TileConfig

SKIP = 77


_GROUPS_ROWS = {"small": (64, 1), "medium": (1 << 12, 1), "large": (1 << 16, 2)}
"""(groups, rows) per size class of ``TileConfig`` (tiles and warps differ between them)."""


def _compile_ptx(fn, ptrs: dict[str, str], consts: dict[str, int | float], arch: int, size: str = "large") -> str:
    """One kernel variant -> PTX text. Ints are typed i32 with Triton's usual divisibility-16
    specialisation, as the launchers' calls on aligned sizes get."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = TileConfig(int(consts["GROUP_SIZE"]), *_GROUPS_ROWS[size])
    consts = dict(consts, BLOCK_G=cfg.block_g, BLOCK_GS=cfg.block_gs)
    sig = {name: ptrs.get(name, "i32") for name in fn.arg_names}
    div16 = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name not in consts and name not in ("k", "seed", "tiles_per_row")
    }
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div16)
    opts = dict(LAUNCH_OPTS, num_warps=cfg.num_warps)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts).asm["ptx"]


def _variants(full: bool):
    """(name, kernel, pointer types, constexprs) for each variant to compile."""
    # modules by name: the package re-exports functions called quantize / reduce's names
    qm = importlib.import_module(__package__ + ".quantize")
    rm = importlib.import_module(__package__ + ".reduce")
    f32 = "*fp32"
    codes = {8: "*i8", 4: "*u8"}
    dtypes = ("fp32", "bf16", "fp16") if full else ("bf16",)
    for dt, bits, st in itertools.product(dtypes, (8, 4), (False, True) if full else (True,)):
        gs = 100 if bits == 4 else 512  # a non-power-of-two and a power-of-two group
        yield (
            f"quantize {dt} int{bits} g{gs} stochastic={st}",
            qm._quantize_kernel,
            {"x_ptr": "*" + dt, "codes_ptr": codes[bits], "scales_ptr": f32},
            dict(GROUP_SIZE=gs, BITS=bits, QMAX=2 ** (bits - 1) - 1, STOCHASTIC=st),
        )
        yield (
            f"dequantize int{bits} -> {dt}",
            qm._dequantize_kernel,
            {"codes_ptr": codes[bits], "scales_ptr": f32, "out_ptr": "*" + dt},
            dict(GROUP_SIZE=128, BITS=bits),
        )
        yield (
            f"dequantize_sum int{bits} -> {dt}",
            rm._dequantize_sum_kernel,
            {"codes_ptr": codes[bits], "scales_ptr": f32, "out_ptr": "*" + dt},
            dict(GROUP_SIZE=128, BITS=bits),
        )
    for ib, ob in ((4, 4), (8, 4), (4, 8)) if full else ((4, 8),):
        for st in (False, True):
            yield (
                f"dequantize_sum_requantize int{ib} -> int{ob} stochastic={st}",
                rm._dequantize_sum_requantize_kernel,
                {"codes_ptr": codes[ib], "scales_ptr": f32, "out_codes_ptr": codes[ob], "out_scales_ptr": f32},
                dict(GROUP_SIZE=128, IN_BITS=ib, OUT_BITS=ob, QMAX=2 ** (ob - 1) - 1, STOCHASTIC=st),
            )


_TILE_KEYS = ("BLOCK_G", "BLOCK_GS", "num_warps", "enable_fp_fusion", "enable_reflect_ftz")


def _format_variants(full: bool):
    """The float formats' kernels (``triton_formats.py``), one variant per element format and
    code width (8, 6, 4 bits; INT8; E5M2's IEEE specials), both MX scale rules, and with ``full``
    every input / output dtype and both roundings. The constexprs are the launchers' own (read
    from their cached plans), so what compiles here is what launches."""
    fm = importlib.import_module(__package__ + ".triton_formats")
    rm = importlib.import_module(__package__ + ".triton_format_reduce")

    def consts(launch) -> dict:
        return {k: v for k, v in launch.meta.items() if k not in _TILE_KEYS}

    f32, u8 = "*fp32", "*u8"
    dtypes = ("fp32", "bf16", "fp16") if full else ("bf16",)
    cases = [("fp8", "e4m3", 100, "ocp"), ("fp8", "e5m2", 512, "ocp")]
    cases += [("mx", e, 32, r) for e in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8") for r in ("ocp", "round_up")]
    cases += [("nvfp4", "e2m1", 16, "ocp")]
    for (scheme, elem, gs, rule), dt in itertools.product(cases, dtypes):
        if not full and scheme == "mx" and (rule == "round_up") != (elem in ("e5m2", "e2m3", "int8")):
            continue  # representative: each element format once, each rule over several formats
        scales = f32 if scheme == "fp8" else u8
        for st in (False, True) if full else (True,):
            q = fm.quantize_plan(scheme, 2, 1 << 16, elem, gs, rule, st)
            ptrs = {"x_ptr": "*" + dt, "codes_ptr": u8, "scales_ptr": scales, "row_absmax_ptr": f32, "tensor_ptr": f32}
            yield (
                f"format {scheme}/{elem} {rule} quantize {dt} g{gs} stochastic={st}",
                q.launch.kernel,
                ptrs,
                consts(q.launch),
            )
        if scheme == "nvfp4":
            yield (
                f"format nvfp4 row absmax {dt}",
                q.absmax.kernel,
                {"x_ptr": "*" + dt, "part_ptr": f32},
                consts(q.absmax),
            )
        d = fm.dequantize_plan(scheme, 2, 1 << 16, elem, gs, (1, 1, 1, 1) if scheme == "nvfp4" else (1, 1, 1))
        ptrs = {"codes_ptr": u8, "scales_ptr": scales, "tensor_ptr": f32, "out_ptr": "*" + dt}
        if rule == "ocp" or not full:  # the dequantize kernels do not depend on the rule
            yield (f"format {scheme}/{elem} dequantize -> {dt}", d.launch.kernel, ptrs, consts(d.launch))
            s = rm.sum_plan(scheme, 4, 2, 1 << 16, elem, gs, (1, 1, 1, 1))
            yield (
                f"format {scheme}/{elem} dequantize_sum -> {dt}",
                s.kernel,
                {"wire_ptr": u8, "out_ptr": "*" + dt},
                consts(s),
            )
    yield from _format_requantize_variants(full)


def _format_requantize_variants(full: bool):
    """The float formats' fused re-quantize kernels (``triton_format_reduce.py``): every fp8 / mx
    input format into the scheme's narrowest one, MXFP6 E2M3 under the round-up rule and MXINT8
    into itself (with ``full``: into each of the scheme's formats), both roundings; nvfp4 re-quantizes with the sum
    and quantize kernels above."""
    rm = importlib.import_module(__package__ + ".triton_format_reduce")
    u8, f32 = "*u8", "*fp32"
    cases = [("fp8", e, o, 100, "ocp") for e in ("e4m3", "e5m2") for o in ("e4m3", "e5m2")]
    mx = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8")
    cases += [("mx", e, o, 32, "round_up" if o == "e2m3" else "ocp") for e in mx for o in mx]
    for scheme, elem, out, gs, rule in cases:
        narrowest = "e4m3" if scheme == "fp8" else "e2m1"
        if not full and out != narrowest and (elem, out) not in (("e4m3", "e2m3"), ("int8", "int8")):
            continue  # representative: each input into the narrowest, the round-up rule, MXINT8's hop
        for st in (False, True):
            plan = rm.requantize_plan(scheme, 4, 2, 1 << 16, elem, out, gs, rule, st, (1, 1, 1, 1, 1))
            ptrs = {"wire_ptr": u8, "codes_ptr": u8, "scales_ptr": f32 if scheme == "fp8" else u8}
            consts = {k: v for k, v in plan.meta.items() if k not in _TILE_KEYS}
            yield (f"format {scheme}/{elem} -> {out} {rule} requantize stochastic={st}", plan.kernel, ptrs, consts)


def check(arch: int = 90, full: bool = False) -> list[str]:
    """Compile the variants (each in every size class with ``full``, else in the large class: the
    largest tiles); return a list of problems (empty when all is well)."""
    problems = []
    variants = [*_variants(full), *_format_variants(full)]
    for (name, fn, ptrs, consts), size in itertools.product(variants, _GROUPS_ROWS if full else ("large",)):
        name = f"{name} [{size}]"
        ptx = _compile_ptx(fn, ptrs, consts, arch, size)
        if re.search(r"\bfma\.", ptx):
            problems.append(f"{name}: fused multiply-add in PTX (fp contraction must be off)")
        if re.search(r"\bdiv\.(rn\.ftz|full|approx)", ptx):
            problems.append(f"{name}: approximate or flush-to-zero division in PTX")
        if name.startswith("format") and re.search(r"\.ftz\b", ptx):
            problems.append(f"{name}: a flush-to-zero instruction in PTX (subnormals must survive)")
        divides = name.startswith(("format fp8", "format nvfp4")) and " quantize " in name
        divides = divides or (name.startswith("format fp8") and " requantize " in name)
        if name.startswith("quantize") or name.startswith("dequantize_sum_requantize") or divides:
            if "div.rn.f32" not in ptx:
                problems.append(f"{name}: no IEEE division (div.rn.f32) found")
        print(f"ok  {name}" if not any(p.startswith(name) for p in problems) else f"BAD {name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--all", action="store_true", help="every dtype / bits / stochastic variant")
    args = p.parse_args(argv)
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        print("compile check needs triton without TRITON_INTERPRET=1")
        return SKIP
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        _ = get_ptxas(args.arch).path  # raises where no ptxas is installed
    except Exception as exc:
        print(f"no ptxas available for sm_{args.arch}: {exc}")
        return SKIP
    problems = check(args.arch, args.all)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
