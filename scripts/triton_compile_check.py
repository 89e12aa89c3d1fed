"""Compile the Pola and PaCS Triton kernels for a GPU that is not here, and report their registers and spills.

The interpreter (how CI runs the kernels) accepts code that the GPU compiler rejects, and says nothing about
register pressure; this compiles every kernel variant to PTX for an sm_90 target with the ptxas that ships with
triton, no GPU or driver needed, and prints ``ptxas -v``'s registers and spill bytes per variant.

    python scripts/triton_compile_check.py [--arch 90] [--dtypes bf16 fp32] [--widths 64 32] [--match backward]

Run it without ``TRITON_INTERPRET`` set (the kernels must be compiled objects, not interpreted ones).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from polaformer.backends.triton.common import dots, padded_width, warps
from polaformer.ops.pacs import triton as pacs
from polaformer.ops.pola import triton as pola

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ACCUMULATORS = ("part_ptr", "state_ptr", "grad_part_ptr", "grad_param_ptr", "grad_temp_ptr")


def _argument_type(name: str, dtype: str) -> str:
    """The Triton type of a kernel argument, from the kernels' naming: pointers end in ``_ptr``."""
    if name == "mask_ptr":
        return "*u8"
    if name in ("cu_q_ptr", "cu_k_ptr"):
        return "*i32"
    if name in ACCUMULATORS:
        return "*fp32"
    if name.endswith("_ptr"):
        return f"*{dtype}"
    return "fp32" if name in ("eps", "alpha") else "i32"


def compile_kernel(kernel, dtype: str, constants: dict, num_warps: int, arch: int):
    """The compiled kernel (raises what the compiler raises)."""
    signature = {name: "constexpr" if name in constants else _argument_type(name, dtype) for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def resources(compiled, arch: int) -> str:
    """``ptxas -v``'s registers and spills of a compiled kernel."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(PTXAS), "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return " ".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                    if "registers" in line or "spill" in line)


def variants(dtypes, widths):
    """(label, kernel, dtype, constants, warps) of every kernel as the layers call it (the raw parameters, the
    local branch and the gate fused): one-launch and split plans, with and without a mask, RoPE for PaCS; each
    dtype with the products a call of that dtype takes (``common.dots``)."""
    for dtype in dtypes:
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        products = dots(torch.empty(0, dtype=half)).constants()
        for d in widths:
            dp = padded_width(d)
            base = dict(BLOCK=32, DP=dp, DVP=dp, PACKED=False, ACC=tl.float32, **products)
            # the layers' calls: the exponent's and scale's raw weights, key positions, local branch and gate
            layer = dict(POWER_WEIGHT=True, HAS_SCALE=True, HAS_POS=True)
            epilogue = dict(HAS_LOCAL=True, HAS_GATE=True)
            w = warps(dp, dp)
            yield f"pola forward d{d}", pola._forward_kernel, dtype, dict(base, SPANS=4, SPLITS=0, HAS_MASK=True,
                                                                         SAVE_STATE=True, **layer, **epilogue), w
            yield f"pola split forward d{d}", pola._forward_kernel, dtype, dict(base, SPANS=4, SPLITS=4, HAS_MASK=False,
                                                                               SAVE_STATE=True, **layer, **epilogue), w
            yield f"pola key state d{d}", pola._state_kernel, dtype, dict(base, SPLITS=4, HAS_MASK=True, **layer), w
            yield f"pola backward d{d}", pola._backward_kernel, dtype, dict(base, SPANS=1, PARTS=1, HAS_MASK=True,
                                                                           **layer, **epilogue), w
            yield f"pola split backward d{d}", pola._backward_kernel, dtype, dict(base, SPANS=4, PARTS=8,
                                                                                 HAS_MASK=False, **layer, **epilogue), w
            yield f"pola key gradients d{d}", pola._key_grad_kernel, dtype, dict(base, SPANS=4, SPLITS=4, PARTS=8,
                                                                                HAS_MASK=True, **layer), w
            p, dvh = padded_width((d + 1) // 2), padded_width(d // 2)
            base = dict(P=p, DVH=dvh, BLOCK=16, PACKED=False, ROPE=True, ACC=tl.float32, **products)
            epilogue = dict(RAW=True, HAS_LOCAL=True, HAS_GATE=True)
            w = warps(2 * p, 4 * dvh)
            yield f"pacs forward d{d}", pacs._forward_kernel, dtype, dict(base, SPANS=4, SPLITS=0, HAS_MASK=True,
                                                                         SAVE_STATE=True, **epilogue), w
            yield f"pacs split forward d{d}", pacs._forward_kernel, dtype, dict(base, SPANS=4, SPLITS=4,
                                                                               HAS_MASK=False, SAVE_STATE=True,
                                                                               **epilogue), w
            yield f"pacs key state d{d}", pacs._state_kernel, dtype, dict(base, SPLITS=4, HAS_MASK=True), w
            yield f"pacs backward d{d}", pacs._backward_kernel, dtype, dict(base, SPANS=1, TEMP_PARTS=1,
                                                                           HAS_MASK=True, **epilogue), w
            yield f"pacs split backward d{d}", pacs._backward_kernel, dtype, dict(base, SPANS=4, TEMP_PARTS=4,
                                                                                 HAS_MASK=False, **epilogue), w
            yield f"pacs key gradients d{d}", pacs._key_grad_kernel, dtype, dict(base, SPANS=4, SPLITS=4,
                                                                                HAS_MASK=True), w


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80 (A100)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--widths", nargs="+", type=int, default=[64, 32], help="head widths")
    parser.add_argument("--match", nargs="+", default=[""], help="only the variants whose label holds one of these")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    for label, kernel, dtype, constants, num_warps in variants(args.dtypes, args.widths):
        if not any(part in label for part in args.match):
            continue
        compiled = compile_kernel(kernel, dtype, constants, num_warps, args.arch)
        print(f"{label:28} {dtype:5} warps {num_warps}: {resources(compiled, args.arch)}")


if __name__ == "__main__":
    main()
