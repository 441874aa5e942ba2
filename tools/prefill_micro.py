"""Micro timing: reference prefill vs the kernel at B256 x 128 (Qwen3-1.7B heads: 16 q / 8 kv, D 128)."""
import sys, time, torch
sys.path.insert(0, ".")
from tests.kernel_cases import make_format, random_prefill_case, fast_prefill, clone_cache
from kv4rl.engine.attention import reference_paged_attention
from kv4rl.engine.fast_path import FastAttention
from tests.kernel_cases import prefill_inputs
dev = torch.device("cuda")
for name in ["bf16", "fp8", "int4", "kv4"]:
    for B, P, Q in [(256, 0, 128), (8, 0, 2048), (64, 1024, 256)]:
        gen = torch.Generator().manual_seed(0)
        fmt = make_format(name, 128, n_sink=16, n_recent=128)
        cache, meta, q, k, v = random_prefill_case(fmt, [P]*B, [Q]*B, 8, 16, 128, 16, dev, gen)
        fast = FastAttention(fmt, 8, 128, 16, dev, num_q_heads=16)
        inputs = prefill_inputs(fast, fmt, meta, 16)
        def t(f, n=10):
            f(); torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(n): f()
            torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e3
        tr = t(lambda: reference_paged_attention(q, k, v, cache, fmt, meta))
        tf = t(lambda: fast.prefill(cache, q, k, v, inputs))
        flops = 4 * B * 16 * 128 * (Q * P + Q * Q / 2)
        print(f"{name:5s} B{B} prefix {P} new {Q}: reference {tr:8.2f} ms  kernel {tf:7.3f} ms  ({flops / tf / 1e9:.0f} TFLOP/s)", flush=True)
