"""Time the fused q/k norm + RoPE kernel (CUDA graphs), with and without the cache's Hadamard rotation, over
tokens a program and warps, at Qwen3 head shapes. Prints us a call per setting and writes JSON.

    python tools/rope_time.py --tokens 16,64,4096,32768 --q-heads 32 --settings 16x4,32x4,64x4,128x4,64x8,128x8
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv4rl.bench.decode_attn import _time_graph  # noqa: E402
from kv4rl.kernels import rope  # noqa: E402
from kv4rl.models.layers import RotaryEmbedding  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,4096,32768")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--settings", default="16x4,32x4,64x4,128x4,64x8,128x8",
                   help="(token, head) rows a program x warps")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rotary = RotaryEmbedding(128, 40960, 1e6, None, device="cuda")
    w = torch.ones(128, dtype=torch.bfloat16, device="cuda")
    results = []
    for n in (int(t) for t in a.tokens.split(",")):
        q = torch.randn(n, a.q_heads, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(n, 8, 128, device="cuda").to(torch.bfloat16)
        pos = torch.arange(n, device="cuda") % 40960
        call = functools.partial(rope.qk_norm_rope, q, k, w, w, 1e-6, rotary.cos, rotary.sin, pos)
        row = {"tokens": n, "plain_us": 1e3 * _time_graph(call)}
        for setting in a.settings.split(","):
            rows, warps = (int(x) for x in setting.split("x"))
            rotated = functools.partial(call, rotate=True, block_rows=rows, num_warps=warps)
            row[f"rotated_{setting}_us"] = 1e3 * _time_graph(rotated)
        results.append(row)
        print(f"{n:6d} tokens x {a.q_heads}+8 heads: " + ", ".join(f"{key[:-3]} {val:.1f} us" for key, val in row.items()
                                                                   if key.endswith("_us")), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
