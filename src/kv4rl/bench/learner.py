"""`kv4rl bench learner`: one learner step's throughput, padded vs packed (packed with each attention
kernel asked for: SDPA's dense block-diagonal mask or FlexAttention's block mask), with/without
activation checkpointing and the reference forward, on a random-init model of a real shape.

Every variant runs the same synthetic batch through `Learner.step` (FSDP2 at world size 1, bf16
mixed precision on CUDA): a warm-up step, then `steps` timed steps between CUDA synchronisations.
Tokens are real tokens (prompt + response, never padding). Model FLOPs per step are
`6·N·tokens + attention` for the update, plus `2·N·tokens + attention` for the reference forward when
it runs; `N` counts the weights of every linear layer (the LM head included, the embedding lookup
not), attention is causal (`6·s²·heads·head_dim` per layer and sequence for forward + backward, a
third of that for a forward). Activation checkpointing's recomputation is not counted (model FLOPs,
not hardware FLOPs). `fuse` times the policy with and/or without `trainer.fuse_elementwise`, `compile`
with and/or without `trainer.compile_layers` (the reference forward, shared by the variants, stays
eager). MFU is against 989 TFLOP/s (H100/H200
dense BF16) and also given against 780 TFLOP/s. A variant that runs out of GPU memory is reported as such and the others still run. Padded rows always
run SDPA; FlexAttention's one-off compilation falls in the warm-up step. Each variant is handed to
`on_result` as soon as it is timed, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.bench.random_model import _shape, random_hf_qwen3
from kv4rl.trainer.batch import TrainBatch, build_batch
from kv4rl.trainer.compiled_layers import forget_compiled_graphs
from kv4rl.trainer.learner import Learner

PEAK_FLOPS = 989e12
ALT_PEAK_FLOPS = 780e12


@dataclass(kw_only=True)
class LearnerWorkload:
    """`uniform`: `num_seqs` rows of exactly `seq_len` tokens (`prompt_len` of them prompt).
    `lognormal`: `num_seqs` responses after `prompt_len`-token prompts, log-normal lengths (median,
    sigma) capped at `max_len`."""

    kind: str = "uniform"
    num_seqs: int = 16
    prompt_len: int = 256
    seq_len: int = 4096
    median_len: int = 1024
    sigma: float = 1.0
    max_len: int = 8192
    seed: int = 0

    def validate(self, max_positions: int) -> None:
        if self.kind not in ("uniform", "lognormal"):
            raise ValueError(f"--workload: '{self.kind}' is not one of uniform, lognormal")
        for option, value in (("--num-seqs", self.num_seqs), ("--prompt-len", self.prompt_len),
                              ("--seq-len", self.seq_len), ("--median-len", self.median_len),
                              ("--max-len", self.max_len)):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if self.sigma < 0:
            raise ValueError(f"--sigma must be >= 0, got {self.sigma}")
        if self.kind == "uniform" and self.seq_len <= self.prompt_len:
            raise ValueError(f"--seq-len {self.seq_len} must exceed --prompt-len {self.prompt_len} "
                             "(every row needs a response token)")
        if self.kind == "lognormal" and self.median_len > self.max_len:
            raise ValueError(f"--median-len {self.median_len} exceeds --max-len {self.max_len}")
        if self.longest() > max_positions:
            which = "--seq-len" if self.kind == "uniform" else "--prompt-len + --max-len"
            raise ValueError(f"rows of up to {self.longest()} tokens exceed the model's {max_positions} positions "
                             f"(lower {which})")

    def response_lengths(self) -> list[int]:
        if self.kind == "uniform":
            return [self.seq_len - self.prompt_len] * self.num_seqs
        rng = random.Random(self.seed)
        return [max(1, min(self.max_len, round(self.median_len * math.exp(rng.gauss(0.0, self.sigma)))))
                for _ in range(self.num_seqs)]

    def longest(self) -> int:
        return self.prompt_len + (self.seq_len - self.prompt_len if self.kind == "uniform" else self.max_len)


def synthetic_batch(work: LearnerWorkload, vocab: int) -> TrainBatch:
    """Random tokens with the workload's lengths; advantages ±1, behaviour log-probs of a uniform policy."""
    g = torch.Generator().manual_seed(work.seed)
    responses = work.response_lengths()
    prompts = [torch.randint(1, vocab, (work.prompt_len,), generator=g).tolist() for _ in responses]
    tokens = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in responses]
    uniform = -math.log(vocab)
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(responses))]
    return build_batch(prompts, tokens, [[uniform] * n for n in responses], [[0] * n for n in responses],
                       advantages, pad_id=0)


def matmul_params(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops(lengths: list[int], layers: int, heads: int, head_dim: int, passes: int) -> float:
    """Causal attention FLOPs: QKᵀ and AV are 2·s²·heads·head_dim each, halved by the causal mask;
    `passes` = 3 for forward + backward, 1 for a forward."""
    return passes * layers * sum(2.0 * s * s * heads * head_dim for s in lengths)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops_utilization(flops: float, step_s: float, device: torch.device) -> dict[str, float | None]:
    """`mfu` (against PEAK_FLOPS) and `mfu_780` (ALT_PEAK_FLOPS) of a step; None off CUDA, where a GPU's peak
    means nothing (the table says "MFU only on a GPU", and the JSON carried a number all the same)."""
    if device.type != "cuda":
        return {"mfu": None, "mfu_780": None}
    return {"mfu": flops / step_s / PEAK_FLOPS, "mfu_780": flops / step_s / ALT_PEAK_FLOPS}


def bench_learner(shape: str, work: LearnerWorkload, *, device: torch.device, steps: int = 2,
                  micro_batch_size: int = 4, max_tokens: int = 16384, layouts=("padded", "packed"),
                  attentions=("sdpa",), checkpointing=(False, True), reference=(False, True), fuse=(False,),
                  compile=(False,), fused_logprobs=(False,), algo: AlgoConfig | None = None,
                  progress: Callable[[str], None] = lambda _: None,
                  on_result: Callable[[dict], None] = lambda _: None) -> dict:
    """Time `Learner.step` for every layout (x attention, packed) x checkpointing x reference variant, each under
    `algo` (default: the run default, PPO-clip); `on_result(summary)` after each variant, with those timed so far."""
    algo = algo or AlgoConfig()
    config = _shape(shape)
    batch = synthetic_batch(work, config["vocab_size"])
    lengths = batch.attention_mask.sum(1).tolist()
    tokens = int(sum(lengths))
    response_tokens = int(batch.response_mask.sum())
    heads, layers, head_dim = config["num_attention_heads"], config["num_hidden_layers"], config["head_dim"]
    ref = random_hf_qwen3(shape, device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                          seed=work.seed) if any(reference) else None
    results = []

    def summary(n_params: int, complete: bool) -> dict:
        return {
            "shape": shape, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "workload": asdict(work), "steps": steps, "micro_batch_size": micro_batch_size,
            "max_tokens_per_micro_batch": max_tokens, "matmul_params": n_params,
            "num_seqs": len(batch), "tokens": tokens, "response_tokens": response_tokens,
            "sequence_lengths": lengths, "padded_width": int(batch.input_ids.shape[1]),
            "peak_flops": PEAK_FLOPS, "alt_peak_flops": ALT_PEAK_FLOPS, "complete": complete, "results": results,
            "algo": {"entropy_coeff": algo.entropy_coeff, "top_entropy_quantile": algo.top_entropy_quantile},
        }

    for ckpt, fused, compiled, head in [(c, f, k, h) for c in checkpointing for f in fuse for k in compile
                                        for h in fused_logprobs]:
        policy = random_hf_qwen3(shape, device, dtype=torch.float32, seed=work.seed)
        n_params = matmul_params(policy)
        learner = Learner(policy, None, algo=algo, lr=1e-7, weight_decay=0.0, betas=(0.9, 0.999),
                          grad_clip=1.0, micro_batch_size=micro_batch_size, updates_per_batch=1, temperature=1.0,
                          device=device, grad_checkpointing=ckpt, ref_kl_every=1, attention="sdpa",
                          fuse_elementwise=fused, compile_layers=compiled, fused_logprobs=head)
        for layout, attention in [(lay, a) for lay in layouts for a in (attentions if lay == "packed" else ["sdpa"])]:
            learner.max_tokens = max_tokens if layout == "packed" else None
            computed = tokens if layout == "packed" else len(batch) * batch.input_ids.shape[1]
            for with_ref in reference:
                if ref is not None:  # off the GPU when not used, so it does not count in the peak memory
                    ref.to(device if with_ref else "cpu")
                learner.ref_model = ref if with_ref else None
                learner.set_attention(attention)  # the policy's and the reference's kernel
                name = (f"{layout} {attention} ckpt={'on' if ckpt else 'off'} ref={'on' if with_ref else 'off'}"
                        + (" fused" if fused else "") + (" compiled" if compiled else "")
                        + (" fused-logprobs" if head else ""))
                progress(name)
                row = {"layout": layout, "attention": attention, "checkpointing": ckpt, "reference": with_ref,
                       "fuse_elementwise": fused, "compile_layers": compiled, "fused_logprobs": head,
                       "micro_batches": len(learner.micro_batches(batch, torch.arange(len(batch)))),
                       "computed_tokens": computed, "padding_fraction": 1.0 - tokens / computed}
                row.update(_time_steps(learner, batch, device, steps))
                if "step_s" in row:
                    flops = 6.0 * n_params * tokens + attention_flops(lengths, layers, heads, head_dim, 3)
                    if with_ref:
                        flops += 2.0 * n_params * tokens + attention_flops(lengths, layers, heads, head_dim, 1)
                    row.update(tokens_per_s=tokens / row["step_s"], flops_per_step=flops,
                               **model_flops_utilization(flops, row["step_s"], device))
                results.append(row)
                on_result(summary(n_params, complete=False))
        del learner, policy
        gc.collect()
        forget_compiled_graphs()  # the next variant's learner compiles its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return summary(n_params, complete=True)


def _time_steps(learner: Learner, batch: TrainBatch, device: torch.device, steps: int) -> dict:
    """A warm-up step, then `steps` timed ones; the peak memory of the timed steps (CUDA only)."""
    try:
        learner.step(batch)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            learner.step(batch)
        _sync(device)
        elapsed = (time.perf_counter() - start) / steps
    except torch.OutOfMemoryError:
        learner.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": "out of GPU memory"}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": elapsed, "peak_gib": peak}
