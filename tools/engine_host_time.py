"""Host work of one engine step with the model and the sampler stubbed out: scheduling, the step's
tally, the runner's bookkeeping, appends and stop checks (not `FastAttention.host_inputs`, which
needs the fast path; bench/kernel_notes.md has its own numbers). On a GPU the engine waits for this
every step, since the next batch depends on the tokens just sampled.

    python tools/engine_host_time.py --batch 256 --steps 200
"""

from __future__ import annotations

import argparse
import time

import torch

from kv4rl.bench.random_model import random_decoder
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the best is reported")
    args = ap.parse_args()
    model = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32, num_layers=1)
    vocab = model.args.vocab_size
    engine = Engine.from_model(model, EngineConfig(kv=KVConfig(format="bf16"),
                                                   max_model_len=args.prompt_len + args.steps * (args.repeats + 1) + 8),
                               max_num_seqs=args.batch)
    params = SamplingParams(max_tokens=args.steps * (args.repeats + 1) + 4, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([1 + (i * 7 + j) % (vocab - 1) for j in range(args.prompt_len)], params)
    engine.step()  # the prefill, on the real model
    logits = torch.zeros(args.batch, vocab)
    tokens, logprobs = torch.full((args.batch,), 1), torch.zeros(args.batch)

    def forward(seqs, pending_ids=None):  # what the runner does to the sequences, without the model
        for s in seqs:
            s.num_cached_tokens += s.num_step_tokens
        return logits[:len(seqs)]

    engine.runner.forward = forward
    engine.runner.sample = lambda seqs, _: (tokens[:len(seqs)], logprobs[:len(seqs)])
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        times.append((time.perf_counter() - start) / args.steps)
    print(f"batch {args.batch}: engine-step host work {min(times) * 1e3:.3f} ms "
          f"(best of {args.repeats} x {args.steps} decode steps; runs {', '.join(f'{t * 1e3:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
