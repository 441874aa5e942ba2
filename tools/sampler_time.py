"""Time the engine's sampler over a full vocabulary, each a CUDA-graph replay (device tool; prints a table,
optionally JSON):

- the sampler of the seventeenth session (`before`: temperature division, a log_softmax written out
  over [B, V], the Gumbel kernel on it, the greedy argmax), `sample` without the runner's flags
  (`no_flags`) and the runner's call now (`now`: `greedy_rows=False, unit_temperature=True` for an RL
  batch at temperature 1; the noise on the scaled logits, the log-sum-exp from the kernel's pass),
  with the tokens that differ from `before` counted;
- the fused Gumbel-max kernel alone without its float32 screen (`unscreened`: float64 noise for every
  element, as before the nineteenth session) after checking it draws the screened kernel's tokens;
- the fused Gumbel-max kernel alone in other work layouts (`--layouts block x warps x programs per SM`),
  after checking that every layout draws the default layout's tokens.

    python tools/sampler_time.py --batches 64,128,256 --layouts 1024x4x4,1024x8x4,2048x8x4,512x4x8
"""

import argparse
import functools
import json

import torch

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.engine.sampler import sample
from kv4rl.kernels import sampling


def _layout(text: str) -> tuple[int, int, int]:
    block, warps, per_sm = text.split("x")
    return int(block), int(warps), int(per_sm)


def _sample_before(logits, temp, seeds, steps):
    """The seventeenth session's untruncated fused path, with every pass over [B, V] it made."""
    greedy = temp <= 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    logprobs_all = scaled.log_softmax(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampling.gumbel_argmax(logprobs_all, seeds, steps, screen=False))
    return tokens, torch.where(greedy, 0.0, logprobs_all.gather(1, tokens[:, None]).squeeze(1))


def _time_batch(b: int, vocab: int, layouts: list[tuple[int, int, int]], sms: int, gen: torch.Generator) -> dict:
    logits = torch.randn(b, vocab, device="cuda", generator=gen) * 3
    rows = {"size": (b,), "device": "cuda"}
    temp, top_k, top_p = torch.ones(**rows), torch.zeros(**rows, dtype=torch.long), torch.ones(**rows)
    seeds = torch.randint(0, 2**62, (b,), device="cuda", generator=gen)
    steps = torch.randint(0, 4096, (b,), device="cuda", generator=gen)
    no_flags = lambda: sample(logits, temp, top_k, top_p, seeds, steps, fused=True, truncated=False)
    now = lambda: sample(logits, temp, top_k, top_p, seeds, steps, fused=True, truncated=False,
                         greedy_rows=False, unit_temperature=True)
    assert all(torch.equal(x, y) for x, y in zip(no_flags(), now())), "the flags changed a token or log-prob"
    before = functools.partial(_sample_before, logits, temp, seeds, steps)
    (old_tokens, old_logprobs), (tokens, logprobs) = before(), now()
    row = {"batch": b, "tokens_unlike_before": int((old_tokens != tokens).sum()),
           "max_logprob_change": float((old_logprobs - logprobs).abs().max()),
           "sample_before_us": 1e3 * _time_graph(before), "sample_no_flags_us": 1e3 * _time_graph(no_flags),
           "sample_now_us": 1e3 * _time_graph(now)}
    lp = logits.log_softmax(-1)
    reference = sampling.gumbel_argmax(lp, seeds, steps)
    unscreened = functools.partial(sampling.gumbel_argmax, lp, seeds, steps, screen=False)
    assert torch.equal(unscreened(), reference), "the float32 screen changed a token"
    row["gumbel_unscreened_us"] = 1e3 * _time_graph(unscreened)
    for block, warps, per_sm in layouts:
        splits = -(-per_sm * sms // b)
        run = functools.partial(sampling.gumbel_argmax, lp, seeds, steps, block=block, splits=splits, num_warps=warps)
        assert torch.equal(run(), reference), f"layout {block}x{warps}x{per_sm} drew other tokens"
        row[f"gumbel_{block}x{warps}x{per_sm}_us"] = 1e3 * _time_graph(run)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary")
    p.add_argument("--layouts", default="1024x4x4,1024x8x4,2048x8x4,512x4x8")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for b in [int(x) for x in a.batches.split(",")]:
        row = _time_batch(b, a.vocab, [_layout(t) for t in a.layouts.split(",") if t], sms, gen)
        results.append(row)
        print(f"B{b:4d}: " + ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in row.items() if k.endswith("_us"))
              + f"; tokens unlike before: {row['tokens_unlike_before']}, log-probs moved <="
              f" {row['max_logprob_change']:.1e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "vocab": a.vocab, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
