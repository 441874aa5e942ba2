"""Time the prefill kernel's launch settings (tiles, warps, stages) per KV format at Qwen3 head shapes
(device tool): each setting runs the engine's prefill of one layer (fused write + attention), its output
compared with the first setting's, and prints the fastest per case against `DEFAULT_PREFILL_LAUNCH`, marking
the one the engine launches there (`prefill_launch`, which picks `LONG_PREFILL_LAUNCH` from this tool's
numbers, bench/RESULTS.md). Timed eagerly with CUDA events, as the numbers recorded there were.

    python tools/prefill_launch_sweep.py --formats kv4,int4 --q-heads 32,16 --json /tmp/sweep.json
    python tools/prefill_launch_sweep.py --grid full --formats kv4 --cases 4:0:2048,16:2048:256
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv4rl.engine.fast_path import FastAttention  # noqa: E402
from kv4rl.kernels import prefill_plan  # noqa: E402
from tests.kernel_cases import make_format, prefill_inputs, random_prefill_case  # noqa: E402

KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
# 128 x 32 at 8 warps: KV4's default tile (4 warps) compiles to 255 registers with 536 B of spills for Triton
# 3.6 on sm_90a, at 8 warps to 212 (2 stages) or 186 (1 stage) with none (tools/prefill_ptxas.py); not timed
CANDIDATES = [(64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 4, 2), (128, 32, 4, 3), (64, 32, 4, 2), (128, 64, 4, 2),
              (128, 32, 8, 2), (128, 32, 8, 1)]
FULL = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))


def _settings(grid: str) -> list[dict]:
    rows = {"full": FULL, "candidates": CANDIDATES, "engine": []}[grid]
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m, n, w, s in rows]


def _time_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def sweep_case(name: str, num_q_heads: int, rows: int, prefix: int, new: int, settings: list[dict]) -> list[dict]:
    """One (format, heads, rows x (prefix + new)) case under the default and each of `settings`."""
    dev = torch.device("cuda")
    fmt = make_format(name, HEAD_DIM, n_sink=16, n_recent=128)
    kind = (fmt.decode_kind, fmt.has_side_rows)
    default = dict(prefill_plan.DEFAULT_PREFILL_LAUNCH[kind])
    engine = prefill_plan.prefill_launch(*kind, prefix + new)  # what the engine launches
    long_from = prefill_plan.LONG_PREFILL_CONTEXT
    cache0, meta, q, k, v = random_prefill_case(fmt, [prefix] * rows, [new] * rows, KV_HEADS, num_q_heads, HEAD_DIM,
                                                BLOCK_SIZE, dev, torch.Generator().manual_seed(0))
    flops = 4 * rows * num_q_heads * HEAD_DIM * (new * prefix + new * new / 2)
    results, first = [], None
    # each setting stands in for the defaults, and no step counts as long, so the engine's query tiles and
    # launch both follow it
    prefill_plan.LONG_PREFILL_CONTEXT = sys.maxsize
    try:
        for setting in [default] + [s for s in [engine] + settings if s != default]:
            prefill_plan.DEFAULT_PREFILL_LAUNCH[kind] = setting
            fast = FastAttention(fmt, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dev, num_q_heads=num_q_heads)
            inputs = prefill_inputs(fast, fmt, meta, num_q_heads)
            cache = {key: t.clone() for key, t in cache0.items()}
            try:
                out = fast.prefill(cache, q, k, v, inputs).float()
                ms = _time_ms(lambda: fast.prefill(cache, q, k, v, inputs))  # noqa: B023
            except Exception as err:  # a setting that does not fit (shared memory, registers) is skipped
                print(f"   {setting}: {type(err).__name__}: {str(err)[:80]}")
                continue
            first = out if first is None else first
            results.append({"format": name, "num_q_heads": num_q_heads, "rows": rows, "prefix": prefix, "new": new,
                            "launch": setting, "default": setting == default, "engine": setting == engine, "ms": ms, "tflops": flops / ms / 1e9,
                            "max_abs_diff_vs_default": (out - first).abs().max().item()})
    finally:
        prefill_plan.DEFAULT_PREFILL_LAUNCH[kind] = default
        prefill_plan.LONG_PREFILL_CONTEXT = long_from
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="kv4,int4")
    p.add_argument("--q-heads", default="32,16", help="query heads (8 KV heads): 32 is Qwen3-8B's, 16 Qwen3-1.7B's")
    p.add_argument("--cases", default="256:0:128,8:0:2048,16:2048:256,64:1024:256", help="rows:prefix:new,...")
    p.add_argument("--grid", choices=("engine", "candidates", "full"), default="candidates",
                   help="engine: only the defaults and the engine's own choice (to compare code, not settings)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    settings, everything = _settings(args.grid), []
    for name in args.formats.split(","):
        for hq in (int(h) for h in args.q_heads.split(",")):
            for rows, prefix, new in cases:
                results = sweep_case(name, hq, rows, prefix, new, settings)
                everything += results
                base = next(r for r in results if r["default"])
                print(f"{name} {hq}/{KV_HEADS} heads, {rows} x ({prefix} + {new}): default {base['ms']:.3f} ms "
                      f"({base['tflops']:.0f} TFLOP/s)", flush=True)
                for r in sorted(results, key=lambda r: r["ms"])[: args.top]:
                    mark = "  (engine's)" if r["engine"] else ""
                    print(f"   {r['ms']:.3f} ms  {base['ms'] / r['ms']:.2f}x  diff {r['max_abs_diff_vs_default']:.1e}  "
                          f"{r['launch']}{mark}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": everything}, indent=1))


if __name__ == "__main__":
    main()
