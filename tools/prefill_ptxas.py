"""Registers and spills of the prefill kernel per launch setting, without a GPU: Triton compiles the kernel
ahead of time for sm_90a (Hopper) and ptxas reports its resources. Device time is scarce; this shows
before a call whether a change moves register pressure (the H200 profile of a short KV4 prefill found 255
registers a thread and 12.5% occupancy, bench/RESULTS.md twenty-sixth session).

Fidelity: the H200 runs Triton 3.6. With it (`pip install --target /tmp/tr36 --no-deps triton==3.6.0`,
then PYTHONPATH=/tmp/tr36) the BF16 kernel at 64 x 64 tiles compiled to 176 registers here against 186 on
the device (ncu); other Triton versions generate other code. ptxas comes from `--ptxas` (default: the
CUDA toolkit's, next to nvcc); Triton's newer PTX header is lowered to what that ptxas reads.

    PYTHONPATH=/tmp/tr36 python tools/prefill_ptxas.py --kinds kv4,bf16 --launches 64,64,4,2 128,32,4,2
    PYTHONPATH=/tmp/tr36 python tools/prefill_ptxas.py --source /tmp/other_prefill_triton.py --kinds kv4
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the engine passes at Qwen3-8B heads (32 query / 8 KV heads of 128, 16-token blocks, KV4 16 + 128)
KINDS = {"bf16": (0, False), "fp8": (1, False), "int4": (2, False), "kv4": (2, True)}
INT_ONE = ("stride_sh", "stride_psh", "stride_fsh")  # strides of 1, which the JIT folds into constants
STRIDE_16 = ("stride_qn", "stride_qh", "stride_ks", "stride_kh", "stride_ps", "stride_ph", "stride_fs", "stride_fh",
             "stride_on", "stride_oh")  # multiples of 16, which the JIT marks divisible


def _pointer_types(kind: int) -> dict[str, str]:
    page = {0: "*bf16", 1: "*fp8e4nv", 2: "*i8"}[kind]
    scale = "*fp32" if kind == 1 else "*fp16"
    types = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": page, "v_ptr": page, "rot_ptr": "*bf16"}
    types |= dict.fromkeys(("ks_ptr", "vs_ptr", "kz_ptr", "vz_ptr"), scale)
    types |= dict.fromkeys(("pk_ptr", "pv_ptr", "fk_ptr", "fv_ptr"), "*i8")
    types |= dict.fromkeys(("pks_ptr", "pvs_ptr", "fks_ptr", "fvs_ptr"), "*fp32")
    types |= dict.fromkeys(("bt_ptr", "lens_ptr", "qstart_ptr", "slots_ptr", "tile_seq_ptr", "tile_q_ptr"), "*i32")
    return types


def compile_ptx(module, kind_name: str, launch: tuple[int, int, int, int], group: int = 4, rotate: str = "q") -> str:
    """PTX of `module._prefill_kernel` for one kind and (BLOCK_M, BLOCK_N, warps, stages); `rotate` (q, qo
    or none) applies to kernels that rotate queries and outputs themselves."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, side = KINDS[kind_name]
    block_m, block_n, warps, stages = launch
    fn = module._prefill_kernel
    names = fn.arg_names
    const = {"KIND": kind, "G": group, "QM": block_m // group, "BLOCK_M": block_m, "BLOCK_N": block_n, "D": 128,
             "BLOCK_SIZE": 16, "SIDE": side, "N_SINK": 16 if side else 0, "N_RECENT": 128 if side else 0,
             "EXACT": False, "ROTATE_Q": "q" in rotate, "ROTATE_O": "o" in rotate, "SIGNS": True,
             "RSQRT_D": 128**-0.5} | dict.fromkeys(INT_ONE, 1)
    const = {k: v for k, v in const.items() if k in names}  # older kernels take fewer settings
    pointers = _pointer_types(kind)
    signature = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "sm_scale_log2" else "i32")
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers or n in STRIDE_16}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in const.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"]


def ptxas_resources(ptx: str, ptxas: str) -> dict:
    """Registers, spill bytes and stack of one kernel's PTX under `ptxas -v` for sm_90a."""
    ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx, count=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed: {run.stderr[-500:]}")
    grab = lambda pattern: int(m.group(1)) if (m := re.search(pattern, run.stderr)) else 0  # noqa: E731
    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=str(ROOT / "src/kv4rl/kernels/prefill_triton.py"),
                   help="the prefill module to compile (another version of it, to compare)")
    p.add_argument("--kinds", default="kv4,bf16")
    p.add_argument("--launches", nargs="+", default=["64,64,4,2", "128,32,4,2"], help="BLOCK_M,BLOCK_N,warps,stages")
    p.add_argument("--rotate", default="q", choices=("none", "q", "qo"),
                   help="for kernels that rotate queries (q) and outputs (o) themselves; KV4's engine default is q")
    p.add_argument("--ptxas", default=shutil.which("ptxas") or str(Path(shutil.which("nvcc") or "nvcc").parent / "ptxas"))
    args = p.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(ROOT / "src"))
    import triton

    spec = importlib.util.spec_from_file_location("prefill_under_test", args.source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    print(f"Triton {triton.__version__}, {args.ptxas}, {args.source}")
    for kind in args.kinds.split(","):
        for launch in args.launches:
            cfg = tuple(int(x) for x in launch.split(","))
            r = ptxas_resources(compile_ptx(module, kind, cfg, rotate=args.rotate), args.ptxas)
            print(f"{kind:5s} {launch:12s} {r['registers']:4d} registers  spills {r['spill_stores']:5d} B stored "
                  f"{r['spill_loads']:5d} B loaded  stack {r['stack']} B")


if __name__ == "__main__":
    main()
