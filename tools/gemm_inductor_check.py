"""Does Inductor's GEMM autotuning beat cuBLAS on the decode step's products? (issue 11's GEMM lead)

At 256 rows the 1.7B step's products run at ~35-50% of the tensor cores' rate (bench/RESULTS.md), and a
hand-written Triton GEMM only tied cuBLAS (twenty-first session). Inductor's max-autotune searches its
own Triton templates (persistent and TMA-fed ones on sm_90) beside cuBLAS per shape; if it finds faster
kernels at these shapes, compiling the products would pay. Times each product of one decoder layer and
the LM head as CUDA-graph replays, cuBLAS (`F.linear`) against the compiled product, and checks the
compiled output against cuBLAS's:

    python tools/gemm_inductor_check.py --shape qwen3-1.7b --rows 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.bench.random_model import QWEN3_SHAPES


def products(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the merged products of one layer and the LM head."""
    s = QWEN3_SHAPES[shape]
    h, d = s["hidden_size"], s["head_dim"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, s["num_attention_heads"] * d), "gate_up": (2 * s["intermediate_size"], h),
            "down": (h, s["intermediate_size"]), "lm_head": (s["vocab_size"], h)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--rows", default="256")
    p.add_argument("--json")
    args = p.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows_out = []
    layers = QWEN3_SHAPES[args.shape]["num_hidden_layers"]
    for m in [int(r) for r in args.rows.split(",")]:
        for name, (n, k) in products(args.shape).items():
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
            ref = F.linear(x, w)
            cublas_ms = _time_graph(lambda x=x, w=w: F.linear(x, w))
            torch._dynamo.reset()
            compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            t0 = time.perf_counter()
            out = compiled(x, w)
            compile_s = time.perf_counter() - t0
            rel = float((out.float() - ref.float()).norm() / ref.float().norm())
            compiled_ms = _time_graph(lambda x=x, w=w, c=compiled: c(x, w))
            flop = 2 * m * n * k
            rows_out.append({"rows": m, "product": name, "n": n, "k": k, "cublas_ms": cublas_ms,
                             "compiled_ms": compiled_ms, "speedup": cublas_ms / compiled_ms, "rel_diff": rel,
                             "cublas_tflops": flop / cublas_ms / 1e9, "compiled_tflops": flop / compiled_ms / 1e9,
                             "compile_s": compile_s})
            print(f"M={m} {name}: cuBLAS {cublas_ms * 1e3:.1f} us, compiled {compiled_ms * 1e3:.1f} us", flush=True)
    print(f"{torch.cuda.get_device_name()}, {args.shape}")
    print(f"{'M':>4} {'product':8} {'N':>6} {'K':>5} {'cuBLAS us':>9} {'TFLOP/s':>7} {'compiled us':>11} "
          f"{'TFLOP/s':>7} {'ratio':>6} {'rel diff':>8}")
    for r in rows_out:
        print(f"{r['rows']:4} {r['product']:8} {r['n']:6} {r['k']:5} {r['cublas_ms'] * 1e3:9.1f} "
              f"{r['cublas_tflops']:7.0f} {r['compiled_ms'] * 1e3:11.1f} {r['compiled_tflops']:7.0f} "
              f"{r['speedup']:5.2f}x {r['rel_diff']:8.1e}")
    for m in sorted({r["rows"] for r in rows_out}):
        sel = [r for r in rows_out if r["rows"] == m]
        step = {key: sum(r[key] * (1 if r["product"] == "lm_head" else layers) for r in sel)
                for key in ("cublas_ms", "compiled_ms")}
        best = sum(min(r["cublas_ms"], r["compiled_ms"]) * (1 if r["product"] == "lm_head" else layers) for r in sel)
        print(f"M={m} step's products: cuBLAS {step['cublas_ms']:.3f} ms, compiled {step['compiled_ms']:.3f} ms, "
              f"best of both per product {best:.3f} ms ({step['cublas_ms'] / best:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
