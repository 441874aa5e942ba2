"""Where a generate call's time goes: prefill vs decode steps, GPU kernels vs host, kernel by kernel.

Runs the engine on one random-init model of a Qwen3 shape (as `kv4rl bench generate` does, without
transformers), every sequence generating exactly `--new-tokens` tokens, once per KV format (and per
weight format with `--weight-formats auto,fp8`), under the torch profiler. Prints, per format: wall time split by step kind (steps that prefill prompt tokens,
pure decode steps), the GPU busy time inside each kind, and the top kernels by GPU time. Writes the
same as JSON. Used for the step breakdown in bench/kernel_notes.md:

    python tools/profile_generate.py --shape qwen3-1.7b --batch 256 --prompt-len 128 --new-tokens 256 \
        --kv-formats bf16,kv4 --json profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kv4rl.bench.generate import random_prompts
from kv4rl.bench.kernel_profile import busy_ms, by_family, kernel_intervals, kernel_rows
from kv4rl.bench.random_model import qwen3_args, random_decoder
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def profile_format(decoder, fmt: str, prompts, new_tokens: int, seed: int, top: int,
                   max_batched: int | None, weights: str = "auto") -> dict:
    cfg = EngineConfig()
    cfg.kv.format = fmt
    cfg.weight_format = weights
    cfg.max_model_len = len(prompts[0]) + new_tokens
    if max_batched:
        cfg.max_num_batched_tokens = max_batched
    engine = Engine.from_model(decoder, cfg, max_num_seqs=len(prompts), seed=seed)
    warm = SamplingParams(max_tokens=4, ignore_eos=True, seed=seed)
    engine.generate(prompts, warm)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=seed)
    steps: list[dict] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params, progress=lambda _: steps.append(dict(engine.last_step)))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prefill = [s for s in steps if s["new_tokens"] != s["batch_size"]]
    decode = [s for s in steps if s["new_tokens"] == s["batch_size"]]
    kernels = kernel_rows(prof)
    families = by_family(kernels)
    out = {
        "kv_format": fmt, "weight_format": weights, "summary": engine.summary, "wall_s": wall,
        "tokens_per_s": len(prompts) * new_tokens / wall,
        "steps": len(steps), "prefill_steps": len(prefill), "decode_steps": len(decode),
        "prefill_wall_s": sum(s["latency_s"] for s in prefill),
        "decode_wall_s": sum(s["latency_s"] for s in decode),
        "decode_step_ms_median": 1e3 * sorted(s["latency_s"] for s in decode)[len(decode) // 2] if decode else None,
        "gpu_busy_ms": busy_ms(kernel_intervals(prof)),  # overlapping kernels once; families sum kernel times
        "gpu_ms_per_step_by_family": {f: ms / len(steps) for f, ms in families.items()},
        "kernels": kernels[:top],
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv-formats", default="bf16,kv4")
    p.add_argument("--weight-formats", default="auto", help="comma-separated: auto (the model's dtype), fp8")
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    decoder = random_decoder(a.shape, dev, dtype=torch.bfloat16, seed=a.seed)
    prompts = random_prompts(qwen3_args(a.shape).vocab_size, a.batch, a.prompt_len, a.seed)
    results = []
    combos = [(w, f) for w in a.weight_formats.split(",") if w for f in a.kv_formats.split(",") if f]
    for weights, fmt in combos:
        torch.cuda.empty_cache()
        r = profile_format(decoder, fmt, prompts, a.new_tokens, a.seed, a.top, a.max_batched_tokens, weights)
        results.append(r)
        print(f"\n== {a.shape} B{a.batch} {a.prompt_len}+{a.new_tokens} weights={weights} kv={fmt}: "
              f"{r['tokens_per_s']:,.0f} tok/s, "
              f"wall {r['wall_s']:.3f} s, {r['steps']} steps ({r['prefill_steps']} with prefill: "
              f"{r['prefill_wall_s']:.3f} s; {r['decode_steps']} decode: {r['decode_wall_s']:.3f} s, "
              f"median {r['decode_step_ms_median']:.2f} ms); GPU busy {r['gpu_busy_ms']:.1f} ms")
        print(f"   {r['summary']}")
        print("   GPU ms per step by family: " + ", ".join(
            f"{f} {ms:.2f}" for f, ms in sorted(r["gpu_ms_per_step_by_family"].items(), key=lambda x: -x[1])))
        for k in r["kernels"]:
            print(f"   {k['gpu_ms']:9.2f} ms {k['calls']:6d}x  {k['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                       "gpu": torch.cuda.get_device_name(dev), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
