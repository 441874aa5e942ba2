"""Time KV4's fused K and V write (Hadamard rotation + INT4 pages + INT8 protected rows) at decode and
prefill sizes, each a CUDA-graph replay (device tool; prints a table, optionally JSON):

- `pair` (the engine's: K and V in one launch, `default_layout`) against `two` (one launch each in the
  16 rows x 4 warps layout, as before);
- `--layouts 16x4,32x4,...`: the pair in other work layouts (rows a program x warps), the same codes;
- `--fp32`: also the IEEE float32 rotation (float32 rows) the write used before the tensor-core dot;
- `--parts`: what a KV4 write is made of, each as the engine launches it (K rotated, V not): with and
  without the rotation and the INT8 copies, and the INT4, FP8 and BF16 formats' writes for scale.

    python tools/kv_write_time.py --tokens 64,128,256,4096 --layouts 8x2,16x4,32x4,32x8,64x8
    python tools/kv_write_time.py --tokens 16,64,128 --parts
"""

import argparse
import functools
import json

import torch

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.engine.kv_formats import get_kv_format
from kv4rl.kernels.kv_write import KVDest, default_layout, write_kv, write_kv_pair


def _layout(text: str) -> tuple[int, int]:
    rows, warps = text.split("x")
    return int(rows), int(warps)


def _destinations(fmt, n: int, hkv: int, d: int, rotate: tuple[bool, bool], protect: bool):
    """A cache of `fmt` for `n` new tokens at random slots: (slots, protected rows or None, {k, v: KVDest}).
    With `protect` every row also gets its INT8 copy, as a decode token (the newest) does."""
    cache = fmt.allocate(2 * n, hkv, d, "cuda", num_seq_slots=n)
    slots = torch.randperm(2 * n, device="cuda")[:n]
    prot = torch.arange(n, device="cuda") * fmt.budget if protect else None
    dests = {}
    for prefix, rot in zip(("k", "v"), rotate):
        out, scale, zero = fmt.paged_tensors(cache, prefix)
        side = (cache[f"{prefix}_prot_codes"], cache[f"{prefix}_prot_scale"]) if protect else (None, None)
        dests[prefix] = KVDest(out, scale, zero, rot, *side)
    return slots, prot, dests


def _time_size(fmt, n: int, hkv: int, layouts: list[tuple[int, int]], fp32: bool, rotate: str = "kv") -> dict:
    """`rotate`: which of K and V the pair layouts rotate ("none": keys rotated before, by the fused RoPE)."""
    d = 128
    slots, prot, dests = _destinations(fmt, n, hkv, d, (rotate != "none", rotate == "kv"), protect=True)
    k, v = (torch.randn(n, hkv, d, device="cuda").to(torch.bfloat16) for _ in range(2))

    def two(k=k, v=v):
        for x, dest in ((k, dests["k"]), (v, dests["v"])):
            write_kv(x, slots, store=fmt.decode_kind, out=dest.out, scale=dest.scale, zero=dest.zero,
                     group_size=128, rotate=True, protect_rows=prot, prot_codes=dest.prot_codes,
                     prot_scale=dest.prot_scale, block_rows=16, num_warps=4)

    def pair(rows=None, warps=None):
        write_kv_pair(k, v, slots, store=fmt.decode_kind, k_dest=dests["k"], v_dest=dests["v"], group_size=128,
                      protect_rows=prot, block_rows=rows, num_warps=warps)

    row = {"tokens": n, "kv_heads": hkv, "default_layout": "x".join(map(str, default_layout(n * hkv, rotate != "none"))), "two_us": 1e3 * _time_graph(two, calls=20),
           "pair_us": 1e3 * _time_graph(pair, calls=20)}
    for rows, warps in layouts:
        row[f"pair_{rows}x{warps}_us"] = 1e3 * _time_graph(functools.partial(pair, rows, warps), calls=20)
    if fp32:
        k32, v32 = k.float(), v.float()
        row["two_fp32_us"] = 1e3 * _time_graph(functools.partial(two, k32, v32), calls=20)
    return row


def _time_parts(n: int, hkv: int) -> dict:
    """us a pair write of `n` tokens: KV4 with K rotated and every row protected, the same without the
    rotation, without the INT8 copies, without both, and the INT4 / FP8 / BF16 formats (no rotation)."""
    d = 128
    row = {"tokens": n, "kv_heads": hkv}
    k, v = (torch.randn(n, hkv, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    cases = {"kv4": ("kv4", True, True), "kv4_no_rotation": ("kv4", False, True), "kv4_no_int8_copy": ("kv4", True, False),
             "kv4_neither": ("kv4", False, False), "int4": ("int4", False, False), "fp8": ("fp8", False, False),
             "bf16": ("bf16", False, False)}
    for name, (fmt_name, rotate, protect) in cases.items():
        fmt = get_kv_format(fmt_name, group_size=128) if fmt_name in ("kv4", "int4") else get_kv_format(fmt_name)
        slots, prot, dests = _destinations(fmt, n, hkv, d, (rotate, False), protect)
        write = functools.partial(write_kv_pair, k, v, slots, store=fmt.decode_kind, k_dest=dests["k"],
                                  v_dest=dests["v"], group_size=128, protect_rows=prot)
        row[f"{name}_us"] = 1e3 * _time_graph(write, calls=20)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,128,256,4096")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layouts", default="", help="extra pair layouts, rows x warps (default: `default_layout`)")
    p.add_argument("--fp32", action="store_true", help="also float32 rows (the IEEE float32 rotation)")
    p.add_argument("--parts", action="store_true", help="time the parts of a KV4 write instead (see above)")
    p.add_argument("--rotate", default="kv", choices=["kv", "k", "none"], help="what the pair layouts rotate")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    fmt = get_kv_format("kv4", group_size=128)
    layouts = [_layout(t) for t in a.layouts.split(",") if t]
    results = []
    for n in [int(x) for x in a.tokens.split(",")]:
        if a.parts:
            row = _time_parts(n, a.kv_heads)
            results.append(row)
            print(f"{n:6d} tokens x {a.kv_heads} heads: " + ", ".join(f"{key[:-3]} {val:.2f} us" for key, val in row.items()
                                                                     if key.endswith("_us")), flush=True)
            continue
        row = _time_size(fmt, n, a.kv_heads, layouts, a.fp32, a.rotate)
        results.append(row)
        print(f"{n:6d} tokens x {a.kv_heads} heads: " + ", ".join(f"{key[:-3]} {val:.1f} us" for key, val in row.items()
                                                                 if key.endswith("_us"))
              + f"  (two / pair {row['two_us'] / row['pair_us']:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
