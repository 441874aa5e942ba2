"""Attention time of one prefill step per layer: the reference path against the prefill kernel (CUDA).

Qwen3-1.7B heads (16 query / 8 KV heads of 128), a fresh random cache per case; each figure is the mean
of 10 calls after one warm-up, write and attention together, as the engine runs them per layer.
Run from the repository root: `PYTHONPATH=src python tools/prefill_micro.py`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv4rl.engine.attention import reference_paged_attention  # noqa: E402
from kv4rl.engine.fast_path import FastAttention  # noqa: E402
from tests.kernel_cases import make_format, prefill_inputs, random_prefill_case  # noqa: E402

CASES = [(256, 0, 128), (8, 0, 2048), (64, 1024, 256)]  # (rows, cached prefix, new tokens per row)


def mean_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    dev = torch.device("cuda")
    for name in ("bf16", "fp8", "int4", "kv4"):
        for rows, prefix, new in CASES:
            fmt = make_format(name, 128, n_sink=16, n_recent=128)
            cache, meta, q, k, v = random_prefill_case(fmt, [prefix] * rows, [new] * rows, 8, 16, 128, 16, dev,
                                                       torch.Generator().manual_seed(0))
            fast = FastAttention(fmt, 8, 128, 16, dev, num_q_heads=16)
            inputs = prefill_inputs(fast, fmt, meta, 16)
            ref_ms = mean_ms(lambda: reference_paged_attention(q, k, v, cache, fmt, meta))  # noqa: B023
            fast_ms = mean_ms(lambda: fast.prefill(cache, q, k, v, inputs))  # noqa: B023
            flops = 4 * rows * 16 * 128 * (new * prefix + new * new / 2)
            print(f"{name:5s} {rows} rows x (prefix {prefix} + {new} new): reference {ref_ms:8.2f} ms, "
                  f"kernel {fast_ms:7.3f} ms ({flops / fast_ms / 1e9:.0f} TFLOP/s causal)", flush=True)


if __name__ == "__main__":
    main()
