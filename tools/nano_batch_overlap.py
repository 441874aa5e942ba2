"""Would two nano-batches on two streams shorten a decode step? (issue 11's 60k tok/s lead, measured)

At the 1.7B shape and 256 rows a decode step is two halves of similar size that use different parts of
the GPU: the products are bound by the tensor cores (~0.88 TFLOP a step), attention by memory (~7.5 GB
of KV at a mean context of 256). Run one after the other, as the engine does, they add up. Split the
rows into two nano-batches whose layers run on two CUDA streams, and one half's attention can run while
the other half's products do; the price is that each product reads its weights twice at M = 128.

This times the decoder's products and the engine's own paged decode-attention kernel (no norms' fusion,
RoPE, KV write or sampler: those are ~0.6 ms a step and do not change between the variants) over
random weights and a random paged cache, every layer its own weights and cache, all in CUDA graphs:

  seq-256    the step as the engine runs it: 256 rows, one stream
  seq-2x128  the two halves one after the other on one stream (what splitting costs the products)
  par-2x128  the two halves on two streams, joined at the end (what overlap gives back)
  lag-2x128  the same, the second half starting once the first has attended in layer 0 (out of phase)
  gemm-256 / attn-256   the step's products alone and its attention alone

    python tools/nano_batch_overlap.py --formats bf16,kv4 --batch 256 --context 256 --json out.json

Prints a table; the outputs of seq-2x128 and par-2x128 must be equal bit for bit (same kernels, same
inputs; the halves' caches are filled apart from the whole batch's, so seq-256 is timed, not compared).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kv4rl.bench.decode_attn import PagedCase, _time_graph
from kv4rl.bench.random_model import QWEN3_SHAPES


def time_graph(fn, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph holding `fn` once."""
    return _time_graph(fn, calls=1, reps=reps)


class Decoder:
    """Random weights of every layer at one shape: q|k|v, o, gate|up, down, the LM head."""

    def __init__(self, shape: str, gen: torch.Generator):
        s = QWEN3_SHAPES[shape]
        self.hidden, self.hq, self.hkv, self.d = (s["hidden_size"], s["num_attention_heads"],
                                                  s["num_key_value_heads"], s["head_dim"])
        self.layers_n, inter, vocab = s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
        qkv = (self.hq + 2 * self.hkv) * self.d

        def w(k, n):
            return (torch.randn(k, n, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)

        self.layers = [{"qkv": w(self.hidden, qkv), "o": w(self.hq * self.d, self.hidden),
                        "gate_up": w(self.hidden, 2 * inter), "down": w(inter, self.hidden)}
                       for _ in range(self.layers_n)]
        self.head = w(self.hidden, vocab)

    def attend(self, i: int, x: torch.Tensor, case: PagedCase | None) -> torch.Tensor:
        """The layer's q|k|v product and attention (the query stands in for it without a case)."""
        h = F.rms_norm(x, (self.hidden,)) @ self.layers[i]["qkv"]
        q = h[:, : self.hq * self.d].reshape(-1, self.hq, self.d)
        if case is None:
            return q.reshape(-1, self.hq * self.d)
        return case.call(q.contiguous()).reshape(-1, self.hq * self.d)

    def finish(self, i: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The layer's o product and MLP."""
        w = self.layers[i]
        x = x + a @ w["o"]
        g, u = (F.rms_norm(x, (self.hidden,)) @ w["gate_up"]).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ w["down"]

    def layer(self, i: int, x: torch.Tensor, case: PagedCase | None) -> torch.Tensor:
        return self.finish(i, x, self.attend(i, x, case))

    def step(self, x: torch.Tensor, cases: list[PagedCase] | None, start: int = 0) -> torch.Tensor:
        for i in range(start, self.layers_n):
            x = self.layer(i, x, None if cases is None else cases[i])
        return F.rms_norm(x, (self.hidden,)) @ self.head


def attention_only(dec: Decoder, x: torch.Tensor, cases: list[PagedCase]) -> torch.Tensor:
    q = x[:, : dec.hq * dec.d].reshape(-1, dec.hq, dec.d).contiguous()
    out = None
    for case in cases:
        out = case.call(q)
    return out


def run(fmt: str, shape: str, batch: int, context: int, seed: int) -> list[dict]:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    dec = Decoder(shape, gen)
    half = batch // 2

    def cases(rows):
        return [PagedCase(fmt, rows, context, dec.hq, dec.hkv, dec.d, "cuda", gen) for _ in range(dec.layers_n)]

    whole, first, second = cases(batch), cases(half), cases(half)
    x = torch.randn(batch, dec.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    xa, xb = x[:half].contiguous(), x[half:].contiguous()
    outs = {}
    fork = torch.cuda.Stream()

    def seq_whole():
        outs["seq-256"] = dec.step(x, whole)

    def seq_halves():
        outs["seq-2x128"] = torch.cat([dec.step(xa, first), dec.step(xb, second)])

    def par_halves():
        main = torch.cuda.current_stream()
        fork.wait_stream(main)
        a = dec.step(xa, first)
        with torch.cuda.stream(fork):
            b = dec.step(xb, second)
        main.wait_stream(fork)
        outs["par-2x128"] = torch.cat([a, b])

    def par_halves_lagged():  # the second half starts once the first has attended in layer 0
        main = torch.cuda.current_stream()
        a0 = dec.attend(0, xa, first[0])
        fork.wait_stream(main)
        with torch.cuda.stream(fork):
            b = dec.step(xb, second)
        a = dec.step(dec.finish(0, xa, a0), first, start=1)
        main.wait_stream(fork)
        outs["lag-2x128"] = torch.cat([a, b])

    def gemm_whole():
        outs["gemm-256"] = dec.step(x, None)

    qkv_rows = torch.randn(batch, dec.hidden * 2, device="cuda", generator=gen).to(torch.bfloat16)

    def attn_whole():
        outs["attn-256"] = attention_only(dec, qkv_rows, whole)

    rows = []
    for name, fn in (("seq-256", seq_whole), ("seq-2x128", seq_halves), ("par-2x128", par_halves),
                     ("lag-2x128", par_halves_lagged),
                     ("gemm-256", gemm_whole), ("attn-256", attn_whole)):
        ms = time_graph(fn)
        rows.append({"format": fmt, "variant": name, "batch": batch, "context": context, "ms": ms})
    torch.cuda.synchronize()
    same = bool(torch.equal(outs["seq-2x128"], outs["par-2x128"])
                and torch.equal(outs["seq-2x128"], outs["lag-2x128"]))
    finite = bool(torch.isfinite(outs["par-2x128"].float()).all())
    base = rows[0]["ms"]
    for r in rows:
        r["vs_seq_256"] = base / r["ms"]
        r["halves_equal"] = same
        r["finite"] = finite
        r["tok_per_s"] = batch / r["ms"] * 1e3 if r["variant"] in ("seq-256", "seq-2x128", "par-2x128", "lag-2x128") else None
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--formats", default="bf16,kv4")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    if args.batch % 2:
        p.error("--batch must be even (two nano-batches)")
    rows = []
    for fmt in args.formats.split(","):
        rows += run(fmt, args.shape, args.batch, args.context, args.seed)
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, {args.shape}, batch {args.batch}, context {args.context}")
    print(f"{'format':6} {'variant':10} {'ms':>7} {'vs seq-256':>10} {'tok/s':>9} {'halves equal':>12}")
    for r in rows:
        tps = f"{r['tok_per_s']:,.0f}" if r["tok_per_s"] else "-"
        print(f"{r['format']:6} {r['variant']:10} {r['ms']:7.3f} {r['vs_seq_256']:9.2f}x {tps:>9} "
              f"{str(r['halves_equal']):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
