"""How close the decode step's weight GEMMs run to the byte roofline (a diagnostic for bench/kernel_notes.md).

A decode step multiplies M = batch rows by every weight matrix once, so at M <= 256 each product should
take about the time to read its weight (bytes / copy bandwidth). This times `F.linear` (what the engine
calls, cuBLAS) for the merged projections of one decoder layer of a Qwen3 shape and its LM head, at the
batch sizes the engine runs, each as a CUDA-graph replay of 20 products (no launch gaps), and prints the
achieved bandwidth of the weight bytes and the share of the measured copy bandwidth:

    python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kv4rl.bench.random_model import qwen3_args


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of the engine's products at `shape`, merged q|k|v and gate|up."""
    a = qwen3_args(shape)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return {"qkv": (a.hidden_size, q + 2 * kv), "o": (q, a.hidden_size), "gate_up": (a.hidden_size, 2 * a.intermediate_size),
            "down": (a.intermediate_size, a.hidden_size), "lm_head": (a.hidden_size, a.vocab_size)}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_graph(lambda: dst.copy_(src), reps=10) / 10)


def time_graph(fn, reps: int) -> float:
    """Seconds of one replay of a CUDA graph holding `reps` calls of fn (median of 20 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    layers = qwen3_args(a.shape).num_layers
    for m in [int(x) for x in a.rows.split(",")]:
        step_ms = roof_ms = 0.0
        for name, (k, n) in layer_shapes(a.shape).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reps = 20
            sec = time_graph(lambda x=x, w=w: F.linear(x, w), reps) / reps
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
