"""Compile the decode-attention kernel for Hopper (sm_90) on any machine, GPU or not, and count the
instructions of its main loop per opcode: the quickest way to see whether a variant is ALU-bound
before spending device time (bench/kernel_notes.md explains the numbers).

    python tools/kernel_sass.py --kind int4 --variant tokens_on_m --magic --block-n 64
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

from kv4rl.kernels import decode_triton as dt
from kv4rl.kernels.decode_common import DecodeKind

POINTERS = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int4": "*u8", "int8_side": "*i8"}
SCALES = {"bf16": "*bf16", "fp8": "*fp32", "int4": "*fp16", "int8_side": "*fp32"}
# integer arguments the JIT specializes as multiples of 16 at the engine's shapes
DIV16 = {"stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_bt", "num_q_heads"}


def compile_kernel(kind: str, tokens_on_m: bool, magic: bool, block_n: int, num_warps: int, num_stages: int,
                   group: int = 4, head_dim: int = 128):
    fn = dt._decode_split_kernel_t if tokens_on_m else dt._decode_split_kernel
    names = fn.arg_names
    consts = {"stride_sh": 1, "KIND": int(DecodeKind[kind.upper()]), "G": group, "BLOCK_H": max(16, group), "D": head_dim,
              "BLOCK_N": block_n, "BLOCK_SIZE": 16, "START": 0, "END_OFF": 0, "N_SINK": 0, "N_RECENT": 0,
              "EXACT": False}
    if tokens_on_m:
        consts["MAGIC"] = magic
    pointers = {"q_ptr": "*bf16", "k_ptr": POINTERS[kind], "v_ptr": POINTERS[kind], "ks_ptr": SCALES[kind],
                "vs_ptr": SCALES[kind], "kz_ptr": SCALES[kind], "vz_ptr": SCALES[kind], "bt_ptr": "*i32",
                "lens_ptr": "*i32", "slots_ptr": "*i32", "split_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "sm_scale_log2" else "i32")
                 for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                           if n in pointers or n in DIV16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest backward-branch loop, per opcode."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        target = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    return len(best), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="int4", choices=list(POINTERS))
    parser.add_argument("--variant", default="heads_on_m", choices=["heads_on_m", "tokens_on_m"])
    parser.add_argument("--magic", action="store_true")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    args = parser.parse_args()
    kernel = compile_kernel(args.kind, args.variant == "tokens_on_m", args.magic, args.block_n, args.num_warps,
                            args.num_stages)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    print(next((line.strip() for line in usage.splitlines() if "REG:" in line), usage))
    count, ops = loop_histogram(sass)
    elements = args.block_n * 128 * 2 // args.num_warps  # K and V values one warp handles per iteration
    print(f"main loop: {count} instructions per warp per {args.block_n}-token tile "
          f"= {count * 32 / elements:.1f} lane-instructions per K/V element")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common(16)))


if __name__ == "__main__":
    main()
