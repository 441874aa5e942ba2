"""Compile the fused elementwise kernels (kv4rl.kernels.fused_ops, kv4rl.kernels.rope) and the FP8 activation quantizer
(kv4rl.kernels.fp8_quant) for Hopper (sm_90) on any machine at Qwen3-1.7B's shapes, print each one's
registers and SASS opcode counts, and check in the PTX that the arithmetic stayed eager's: every float
add/sub/mul carries an explicit `.rn` (which ptxas may not contract into an FMA), no `fma` on
activation-dtype values, SiLU's and the quantizer's divisions are `div.rn.f32`, the quantizer casts
with `cvt.rn.satfinite.e4m3x2.f32` and flushes no subnormal. Exits 1 on a problem
(tests/test_fused_ops.py runs it).

    python tools/fused_ops_sass.py [--dtype bf16|fp16|fp32]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kv4rl.kernels import fp8_quant as fq
from kv4rl.kernels import fused_ops as fo
from kv4rl.kernels import rope as kr

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 16, 8, 128, 6144


def _compile(fn, pointers: dict[str, str], consts: dict, num_warps: int = 4):
    names = fn.arg_names
    floats = ("eps", "inv_c", "inv_d", "inv_max")
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **fo._EAGER_MATH})


def kernels(dtype: str) -> dict:
    """name -> compiled kernel, for each specialisation the decoder launches."""
    act = f"*{dtype}"
    norm_ptrs = {**dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"), act), "scale_ptr": "*fp32"}
    norm_fp8_ptrs = {**norm_ptrs, "out_ptr": "*fp8e4nv"}
    silu_ptrs = {"g_ptr": act, "u_ptr": act, "o_ptr": act}
    rope_ptrs = {**dict.fromkeys(("q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "qo_ptr", "ko_ptr"), act),
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "sign_ptr": act}
    rope_consts = {"BLOCK_HQ": Q_HEADS, "BLOCK_HK": KV_HEADS, "HALF": HEAD_DIM // 2, "BLOCK_HALF": HEAD_DIM // 2}
    # with the rotation into a KV4 cache's key space, over blocks of (token, head) rows
    rotated_consts = {"BLOCK_R": kr.ROTATED_ROWS, "HALF": HEAD_DIM // 2, "RSQRT_D": HEAD_DIM**-0.5, "EXACT": False}
    return {
        "rms_norm": _compile(fo._rms_norm_kernel, norm_ptrs, {"HAS_RESIDUAL": False, "BLOCK_C": HIDDEN,
                                                              "FP8_OUT": False, "RECIPROCAL": True}),
        "add_rms_norm": _compile(fo._rms_norm_kernel, norm_ptrs, {"HAS_RESIDUAL": True, "BLOCK_C": HIDDEN,
                                                                  "FP8_OUT": False, "RECIPROCAL": True}),
        # the norms and SwiGLU that hand FP8 linears their codes (engine.fused_ops with FP8 weights)
        "add_rms_norm_fp8": _compile(fo._rms_norm_kernel, norm_fp8_ptrs, {"HAS_RESIDUAL": True, "BLOCK_C": HIDDEN,
                                                                          "FP8_OUT": True, "RECIPROCAL": True}),
        "silu_mul_fp8": _compile(fo._silu_mul_fp8_kernel, {**silu_ptrs, "o_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
                                 {"LIBDEVICE": True, "RECIPROCAL": True, "BLOCK": fo.row_launch(INTERMEDIATE)[0]},
                                 num_warps=fo.row_launch(INTERMEDIATE)[1]),
        "qk_norm_rope": _compile(kr._qk_norm_rope_kernel, rope_ptrs, {"NORM": True, **rope_consts}),
        "rope": _compile(kr._qk_norm_rope_kernel, rope_ptrs, {"NORM": False, **rope_consts}),
        "qk_norm_rope_rotated": _compile(kr._qk_norm_rope_rows_kernel, rope_ptrs, {"NORM": True, **rotated_consts}),
        "silu_mul": _compile(fo._silu_mul_kernel, silu_ptrs,
                             {"LIBDEVICE": True, "BLOCK": fo._SILU_BLOCK}),
        # FP8Linear's input quantizer as it runs on CUDA, at down_proj's K (two chunks of 4096)
        "quantize_rows_fp8": _compile(fq._quantize_rows_fp8_kernel,
                                      {"x_ptr": act, "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
                                      {"RECIPROCAL": True, "BLOCK_K": fq.launch_shape(INTERMEDIATE)[0]},
                                      num_warps=fq.launch_shape(INTERMEDIATE)[1]),
    }


def sass_of(kernel) -> tuple[str, str]:
    """(resource usage line, SASS) of a compiled kernel, with the cuobjdump bundled with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return next((line.strip() for line in usage.splitlines() if "REG:" in line), usage.strip()), sass


def opcodes(sass: str) -> collections.Counter:
    ins = (re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line) for line in sass.splitlines())
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0] for m in ins if m)


def eager_math_problems(name: str, ptx: str) -> list[str]:
    """Where the PTX of kernel `name` could round differently from eager torch."""
    body = [line.split("//")[0] for line in ptx.splitlines()]
    problems = [f"{name}: contractible `{m.group(0)}`" for line in body
                for m in [re.search(r"\b(add|sub|mul)\.(f32|f16|bf16)(x2)?\b", line)] if m]
    problems += [f"{name}: fused `{m.group(0)}`" for line in body
                 for m in [re.search(r"\bfma\.rn\.(f16|bf16)\w*", line)] if m]
    if name in ("silu_mul", "silu_mul_fp8") and ("div.rn.f32" not in ptx or re.search(r"div\.(full|approx)", ptx)):
        problems.append(f"{name}: the division is not div.rn.f32")
    if name in ("quantize_rows_fp8", "add_rms_norm_fp8", "silu_mul_fp8"):
        if "div.rn.f32" not in ptx or re.search(r"div\.(full|approx)", ptx):
            problems.append(f"{name}: the division is not div.rn.f32")
        if "cvt.rn.satfinite.e4m3x2.f32" not in ptx or re.search(r"cvt\.\w+\.e4m3x2\.f16x2", ptx):
            problems.append(f"{name}: the e4m3 cast is not one cvt.rn.satfinite.e4m3x2.f32")
        # libdevice's expf (SiLU) computes with ex2.approx.ftz as torch's expf does; nothing else may flush
        if re.search(r"\.ftz", ptx.replace("ex2.approx.ftz.f32", "")):
            problems.append(f"{name}: flushes subnormals (.ftz)")
    return problems[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    problems = []
    for name, kernel in kernels(args.dtype).items():
        usage, sass = sass_of(kernel)
        ops = opcodes(sass)
        print(f"{name}: {sum(ops.values())} instructions; {usage}")
        print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
        problems += eager_math_problems(name, kernel.asm["ptx"])
    if problems:
        raise SystemExit("arithmetic that differs from eager:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()
