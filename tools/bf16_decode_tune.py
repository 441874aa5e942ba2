"""Launch settings of the BF16 Triton decode body away from the point they were tuned at.

`DEFAULT_LAUNCH[BF16]` (BLOCK_N 32, 4 warps, 2 stages) is the fastest of a sweep at Qwen3-8B heads, B64 x 8192.
A 1.7B B256 step reads its cache at short contexts (128-384 tokens in `bench generate`'s default), where the
eighteenth session measured the attention at ~3.2 TB/s against cuDNN's 4.4-4.6 at long ones. This times every
setting of a grid at a few (shape, batch, context) points and prints, per point, the default and the best.

    python tools/bf16_decode_tune.py --json $OUT/bf16_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from kv4rl.bench.decode_attn import tune
from kv4rl.kernels.decode_attention import DEFAULT_LAUNCH, DecodeKind

POINTS = [("qwen3-1.7b", 256, 256), ("qwen3-1.7b", 256, 512), ("qwen3-1.7b", 256, 2048), ("qwen3-1.7b", 64, 2048),
          ("qwen3-8b", 64, 8192)]


def configs() -> list[dict]:
    grid = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
            for n, w, s in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3))]
    grid += [{"BLOCK_N": n, "num_warps": w, "num_stages": s, "tokens_on_m": True}
             for n, w, s in itertools.product((64, 128), (4, 8), (2, 3))]
    return grid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--points", default=None, help="shape:batch:context,... (default: the built-in list)")
    args = parser.parse_args()
    points = POINTS if args.points is None else [
        (s, int(b), int(c)) for s, b, c in (p.split(":") for p in args.points.split(","))]
    default = dict(DEFAULT_LAUNCH[DecodeKind.BF16])
    grid = configs()
    if default not in grid:
        grid.insert(0, default)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "default": default, "points": []}
    for shape, batch, context in points:
        t0 = time.perf_counter()
        rows = tune(["bf16"], grid, shape, batch, context)
        ok = [r for r in rows if "ms" in r and r["rel_diff"] < 1e-2]
        bad = [r for r in rows if "ms" in r and r["rel_diff"] >= 1e-2]
        out["points"].append({"shape": shape, "batch": batch, "context": context, "rows": rows})
        base = next((r for r in ok if all(r.get(k) == v for k, v in default.items()) and "tokens_on_m" not in r), None)
        if base is None:  # the default did not compile, or disagreed with the reference: say so, go on
            print(f"{shape} B{batch} x {context}: the default setting failed or was off; see the JSON", flush=True)
            continue
        best = min(ok, key=lambda r: r["ms"])
        print(f"{shape} B{batch} x {context}: default {base['ms'] * 1e3:.1f} us ({base['tbps']:.2f} TB/s), best "
              f"{best['ms'] * 1e3:.1f} us ({best['tbps']:.2f} TB/s) {({k: best[k] for k in grid[-1] if k in best})} "
              f"= {base['ms'] / best['ms']:.3f}x; {len(rows) - len(ok) - len(bad)} failed, {len(bad)} off "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for r in sorted(ok, key=lambda r: r["ms"])[:5]:
            print(f"    {r['ms'] * 1e3:7.1f} us  {r['tbps']:.2f} TB/s  N{r['BLOCK_N']} w{r['num_warps']} "
                  f"s{r['num_stages']}{' tokens_on_m' if r.get('tokens_on_m') else ''} regs {r['regs']} "
                  f"spills {r['spills']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
