"""Time KV4's fused key write (Hadamard rotation + INT4 pages + INT8 protected rows) at decode and prefill
sizes: bf16 rows (the tensor-core dot against the ±1 matrix) against the same rows in float32 (the IEEE
float32 dot every write used before), each a CUDA-graph replay (device tool; prints one line per size):

    python tools/kv_write_time.py --tokens 128,256,8192
"""

import argparse

import torch

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.engine.kv_formats import get_kv_format
from kv4rl.kernels.kv_write import write_kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128,256,8192")
    p.add_argument("--kv-heads", type=int, default=8)
    a = p.parse_args()
    fmt = get_kv_format("kv4", group_size=128)
    hkv, d = a.kv_heads, 128
    for n in [int(x) for x in a.tokens.split(",")]:
        cache = fmt.allocate(2 * n, hkv, d, "cuda", num_seq_slots=n)
        slots = torch.randperm(2 * n, device="cuda")[:n]
        prot = torch.arange(n, device="cuda") * fmt.budget  # every row also protected (decode: the newest token)
        out, scale, zero = fmt.paged_tensors(cache, "k")
        x = torch.randn(n, hkv, d, device="cuda").to(torch.bfloat16)
        kw = {"store": fmt.decode_kind, "out": out, "scale": scale, "zero": zero, "group_size": 128, "rotate": True,
              "protect_rows": prot, "prot_codes": cache["k_prot_codes"], "prot_scale": cache["k_prot_scale"]}
        times = {}
        for label, rows in (("bf16 tensor-core", x), ("fp32 ieee", x.float())):
            times[label] = 1e3 * _time_graph(lambda rows=rows, slots=slots, kw=kw: write_kv(rows, slots, **kw), calls=20)
        print(f"{n:6d} tokens x {hkv} heads: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
              + f" ({times['fp32 ieee'] / times['bf16 tensor-core']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
