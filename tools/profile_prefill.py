"""Where one prefill layer's time goes, kernel by kernel (CUDA): the engine's prefill of one layer
(`FastAttention.prefill`: fused write, query rotation, the prefill kernel, KV4's side-row copies) per KV
format and case, under the torch profiler, at Qwen3 head shapes (8 KV heads of 128). Prints the GPU time
of each kernel a call and writes the same as JSON. The twenty-sixth session's breakdown (bench/RESULTS.md)
came from a throwaway form of this script:

    python tools/profile_prefill.py --formats kv4,bf16 --q-heads 32 --cases 256:0:128,8:0:2048 --json p.json
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
                 device: str = "cuda") -> list[dict]:
    """Kernels of `calls` prefill calls on one random case, GPU ms per call."""
    dev = torch.device(device)
    fmt = make_format(name, HEAD_DIM, n_sink=16, n_recent=128)
    cache, meta, q, k, v = random_prefill_case(fmt, [prefix] * rows, [new] * rows, KV_HEADS, num_q_heads, HEAD_DIM,
                                               BLOCK_SIZE, dev, torch.Generator().manual_seed(0))
    fast = FastAttention(fmt, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dev, num_q_heads=num_q_heads)
    inputs = prefill_inputs(fast, fmt, meta, num_q_heads)
    for _ in range(2):  # compile and warm up
        fast.prefill(cache, q, k, v, inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fast.prefill(cache, q, k, v, inputs)
        torch.cuda.synchronize()
    return [{**r, "calls": r["calls"] / calls, "gpu_ms": r["gpu_ms"] / calls} for r in kernel_rows(prof)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="kv4,bf16")
    p.add_argument("--q-heads", default="32", help="query heads (8 KV heads): 32 is Qwen3-8B's, 16 Qwen3-1.7B's")
    p.add_argument("--cases", default="256:0:128,8:0:2048", help="rows:prefix:new,...")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_prefill: needs a CUDA device")
    results = []
    for name in args.formats.split(","):
        for hq in (int(h) for h in args.q_heads.split(",")):
            for rows, prefix, new in (tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")):
                kernels = profile_case(name, hq, rows, prefix, new)
                total = sum(r["gpu_ms"] for r in kernels)
                print(f"{name} {hq}/{KV_HEADS} heads, {rows} x ({prefix} + {new}): {total * 1e3:.1f} us of GPU time a layer")
                for r in kernels[: args.top]:
                    print(f"   {r['gpu_ms'] * 1e3:9.1f} us  x{r['calls']:g}  {r['name']}")
                results.append({"format": name, "num_q_heads": hq, "rows": rows, "prefix": prefix, "new": new,
                                "gpu_ms": total, "kernels": kernels})
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
