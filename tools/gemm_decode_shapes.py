"""How close the decode step's weight GEMMs run to the byte roofline (a diagnostic for bench/kernel_notes.md).

A decode step multiplies M = batch rows by every weight matrix once, so at M <= 256 each product should
take about the time to read its weight (bytes / copy bandwidth). This times `F.linear` (what the engine
calls, cuBLAS) for the merged projections of one decoder layer of a Qwen3 shape and its LM head, at the
batch sizes the engine runs, each as CUDA-graph replays (no launch gaps), and prints the achieved
bandwidth of the weight bytes and its share of the copy bandwidth the byte roofline uses
(`kv4rl.bench.roofline`):

    python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.bench.random_model import qwen3_args
from kv4rl.bench.roofline import copy_bandwidth


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of the engine's products at `shape`, merged q|k|v and gate|up."""
    a = qwen3_args(shape)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return {"qkv": (a.hidden_size, q + 2 * kv), "o": (q, a.hidden_size), "gate_up": (a.hidden_size, 2 * a.intermediate_size),
            "down": (a.intermediate_size, a.hidden_size), "lm_head": (a.hidden_size, a.vocab_size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    if bw is None:
        raise SystemExit(f"no copy bandwidth measured for {torch.cuda.get_device_name()} (kv4rl.bench.roofline)")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (kv4rl.bench.roofline)")
    rows = []
    layers = qwen3_args(a.shape).num_layers
    for m in [int(x) for x in a.rows.split(",")]:
        step_ms = roof_ms = 0.0
        for name, (k, n) in layer_shapes(a.shape).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sec = _time_graph(lambda x=x, w=w: F.linear(x, w), calls=20) / 1e3
            wbytes = n * k * 2
            count = 1 if name == "lm_head" else layers
            step_ms += 1e3 * sec * count
            roof_ms += 1e3 * wbytes / bw * count
            rows.append({"rows": m, "gemm": name, "in": k, "out": n, "us": 1e6 * sec,
                         "weight_tb_s": wbytes / sec / 1e12, "of_copy": wbytes / sec / bw})
            print(f"M={m:4d} {name:8s} {k:6d}x{n:6d}: {1e6 * sec:8.1f} us  {wbytes / sec / 1e12:5.2f} TB/s "
                  f"({100 * wbytes / sec / bw:4.0f}% of copy)")
        print(f"M={m:4d} all products of a step: {step_ms:.2f} ms against {roof_ms:.2f} ms of weight bytes "
              f"({100 * roof_ms / step_ms:.0f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "copy_tb_s": bw / 1e12, "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
