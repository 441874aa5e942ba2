"""Where one prefill layer's time goes, kernel by kernel (CUDA): the engine's prefill of one layer
(`FastAttention.prefill`: fused write, query rotation, the prefill kernel, KV4's side-row copies) per KV
format and case, under the torch profiler, at Qwen3 head shapes (8 KV heads of 128). Prints the GPU time
of each kernel a call and writes the same as JSON. The twenty-sixth session's breakdown (bench/RESULTS.md)
came from a throwaway form of this script:

    python tools/profile_prefill.py --formats kv4,bf16 --q-heads 32 --cases 256:0:128,8:0:2048 --json p.json
    python tools/profile_prefill.py --formats kv4 --rope in-rope,in-kernels   # where the key rotation runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv4rl.bench.kernel_profile import kernel_rows  # noqa: E402
from kv4rl.engine.fast_path import FastAttention  # noqa: E402
from tests.kernel_cases import make_format, prefill_inputs, random_prefill_case  # noqa: E402

KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16


def profile_case(name: str, num_q_heads: int, rows: int, prefix: int, new: int, calls: int = 5,
                 device: str = "cuda", rope: str | None = None) -> list[dict]:
    """Kernels of `calls` prefill calls on one random case, GPU ms per call. `rope`: each call first runs
    the fused forward's q/k norm + RoPE kernel on the case's q and k, with a rotating cache's rotation in
    it (`in-rope`, the engine's default) or left to the write and a query pass (`in-kernels`)."""
    dev = torch.device(device)
    fmt = make_format(name, HEAD_DIM, n_sink=16, n_recent=128)
    cache, meta, q, k, v = random_prefill_case(fmt, [prefix] * rows, [new] * rows, KV_HEADS, num_q_heads, HEAD_DIM,
                                               BLOCK_SIZE, dev, torch.Generator().manual_seed(0))
    fast = FastAttention(fmt, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dev, num_q_heads=num_q_heads)
    inputs = prefill_inputs(fast, fmt, meta, num_q_heads)
    layer = lambda: fast.prefill(cache, q, k, v, inputs)
    if rope is not None:
        from kv4rl.kernels.rope import qk_norm_rope
        from kv4rl.models.layers import RotaryEmbedding

        rotary = RotaryEmbedding(HEAD_DIM, 40960, 1e6, None, device=dev)
        weights = [torch.ones(HEAD_DIM, dtype=q.dtype, device=dev)] * 2
        positions = torch.arange(q.shape[0], device=dev) % 40960
        rotated = rope == "in-rope" and fmt.rotate != "none"

        def layer():
            q_r, k_r = qk_norm_rope(q, k, *weights, 1e-6, rotary.cos, rotary.sin, positions, rotate=rotated)
            return fast.prefill(cache, q_r, k_r, v, inputs, rotated=rotated)
    for _ in range(2):  # compile and warm up
        layer()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            layer()
        torch.cuda.synchronize()
    return [{**r, "calls": r["calls"] / calls, "gpu_ms": r["gpu_ms"] / calls} for r in kernel_rows(prof)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="kv4,bf16")
    p.add_argument("--q-heads", default="32", help="query heads (8 KV heads): 32 is Qwen3-8B's, 16 Qwen3-1.7B's")
    p.add_argument("--cases", default="256:0:128,8:0:2048", help="rows:prefix:new,...")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--rope", default=None, help="in-rope,in-kernels: include the q/k norm + RoPE kernel, with a "
                   "rotating cache's rotation in it or in the write and a query pass (both: one row each)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_prefill: needs a CUDA device")
    results = []
    for name in args.formats.split(","):
        for hq in (int(h) for h in args.q_heads.split(",")):
            for rows, prefix, new in (tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")):
                for rope in args.rope.split(",") if args.rope else [None]:
                    kernels = profile_case(name, hq, rows, prefix, new, rope=rope)
                    total = sum(r["gpu_ms"] for r in kernels)
                    with_rope = f", with RoPE, rotation {rope}" if rope else ""
                    print(f"{name} {hq}/{KV_HEADS} heads, {rows} x ({prefix} + {new}){with_rope}: "
                          f"{total * 1e3:.1f} us of GPU time a layer")
                    for r in kernels[: args.top]:
                        print(f"   {r['gpu_ms'] * 1e3:9.1f} us  x{r['calls']:g}  {r['name']}")
                    results.append({"format": name, "num_q_heads": hq, "rows": rows, "prefix": prefix, "new": new,
                                    "rope": rope, "gpu_ms": total, "kernels": kernels})
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
