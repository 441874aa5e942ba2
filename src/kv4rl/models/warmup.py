"""The supervised warm-up that makes a testbed model, and the measurements recorded with it.

`warm_up` trains a fresh model on the task's worked solutions (loss on the response tokens only) and stops
where the probability of writing a whole solution reaches the spec's target, so RL still has room to
learn; `measure` then samples held-out problems through the rollout engine with the exact reward, which
is what the first RL iteration sees. `kv4rl.models.testbed` owns the specs, the cache and the folder.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kv4rl.data.char_tokenizer import build_char_tokenizer
from kv4rl.data.synthetic import PROMPT_TEMPLATE
from kv4rl.data.types import Problem
from kv4rl.models.testbed_spec import WARMUP_OPTIMIZER, TestbedSpec, target_text

if TYPE_CHECKING:  # the modeling module loads triton.language at import (see kv4rl.models.testbed)
    from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM


def solution_lengths(spec: TestbedSpec, n: int, seed: int) -> list[int]:
    """Token lengths (EOS included) of the worked solutions of `n` problems: the generator's own lengths."""
    encode = CharEncoder(build_char_tokenizer())
    task = spec.make_task()
    return [len(encode(target_text(task, p))) + 1 for p in task.problems(n, seed=seed)]


def learning_rate_factor(spec: TestbedSpec):
    def factor(step: int) -> float:
        # linear ramp, then cosine down to 10%: the end point moves little from step to step
        ramp = min(1.0, (step + 1) / spec.lr_warmup_steps)
        progress = min(1.0, step / max(spec.steps, 1))
        return ramp * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return factor


@dataclass
class CharEncoder:
    """Char -> id without the tokenizer's per-call overhead (the warm-up encodes ~100k solutions)."""

    tokenizer: PreTrainedTokenizerBase
    table: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        vocab = self.tokenizer.get_vocab()
        self.table = {token: index for token, index in vocab.items() if len(token) == 1}
        self.boxed = vocab["\\boxed{"]

    def __call__(self, text: str) -> list[int]:
        head, sep, tail = text.rpartition("\\boxed{")
        if not sep:
            return [self.table[ch] for ch in text]
        return self(head) + [self.boxed] + self(tail)


def supervised_batch(encode, task, problems: list[Problem], pad_id: int, eos_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + worked solution + EOS` ids, and labels that mask out prompt and padding."""
    rows = [(encode(PROMPT_TEMPLATE.format(problem=p.problem)), encode(target_text(task, p)) + [eos_id])
            for p in problems]
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        labels[row, len(prompt):end] = torch.tensor(response)
    return input_ids, labels  # padding sits after every real token, so causal attention needs no mask


@torch.no_grad()
def solution_probability(model, encode, task, problems: list[Problem], pad_id: int, eos_id: int,
                         device: torch.device, batch_size: int = 64) -> float:
    """Mean over `problems` of the probability that sampling at temperature 1 writes exactly the worked
    solution and EOS: exp(-sequence NLL), from one teacher-forced pass (no generation). Any such sample
    is correct, so this bounds sampled accuracy from below (it misses only lucky wrong-path answers)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(problems), batch_size):
        input_ids, labels = supervised_batch(encode, task, problems[start:start + batch_size], pad_id, eos_id)
        input_ids, labels = input_ids.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=input_ids).logits
        targets, mask = labels[:, 1:], labels[:, 1:] != -100
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total += float(torch.exp((picked * mask).sum(dim=1)).sum())
    model.train(was_training)
    return total / len(problems)


def warm_up(spec: TestbedSpec, model: Qwen3ForCausalLM, tokenizer, bar, device: torch.device) -> dict:
    """Supervised steps on freshly drawn problems (loss on the response tokens only), until `spec.steps` or
    `spec.target_accuracy`. Returns the losses, the steps taken and the last accuracy estimate."""
    rng = random.Random(spec.seed)
    task = spec.make_task()
    encode = CharEncoder(tokenizer)
    held_out = task.problems(256, seed=spec.eval_seed + 1) if spec.target_accuracy is not None else []
    estimate = None
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, fused=cuda,
                                  weight_decay=WARMUP_OPTIMIZER["weight_decay"], betas=WARMUP_OPTIMIZER["betas"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor(spec))
    task_id = bar.add_task(f"building {spec.name}: warm-up", total=spec.steps)
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(spec.steps):
        batch = [task.sample(rng) for _ in range(spec.batch_size)]
        input_ids, labels = supervised_batch(encode, task, batch, tokenizer.pad_token_id, tokenizer.eos_token_id)
        input_ids, labels = input_ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), WARMUP_OPTIMIZER["grad_clip"])
        optimizer.step()
        schedule.step()
        bar.advance(task_id)
        checking = held_out and (step + 1) % spec.check_every == 0
        if checking:
            estimate = solution_probability(model, encode, task, held_out, tokenizer.pad_token_id,
                                            tokenizer.eos_token_id, device)
        if checking or step % 50 == 0 or step + 1 == spec.steps:
            losses.append(round(float(loss.detach()), 5))
            shown = "" if estimate is None else f", exact-solution probability {estimate:.3f}"
            bar.update(task_id, description=f"building {spec.name}: warm-up, loss {losses[-1]:.4f}{shown}")
            if not bar.console.is_terminal and not bar.disable:  # piped: one line per report instead
                bar.console.print(f"warm-up step {step + 1}/{spec.steps}: loss {losses[-1]:.4f}{shown}, "
                                  f"{time.perf_counter() - started:.0f} s", highlight=False)
        if estimate is not None and estimate >= spec.target_accuracy:
            return {"losses": losses, "steps": step + 1, "estimate": estimate}
    return {"losses": losses, "steps": spec.steps, "estimate": estimate}


def measure(model_dir: Path, spec: TestbedSpec, device: torch.device) -> dict:
    """Accuracy (sampled at temperature 1 and greedy) and mean response length on held-out problems, through
    the rollout engine with the exact reward: what the first RL iteration will see."""
    from transformers import AutoTokenizer

    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.engine.config import EngineConfig
    from kv4rl.engine.llm import Engine
    from kv4rl.eval.runner import evaluate
    from kv4rl.rewards import get_reward

    task = spec.make_task()
    problems = task.problems(spec.eval_problems, seed=spec.eval_seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    formatter = PromptFormatter(tokenizer, PROMPT_TEMPLATE)
    lengths = solution_lengths(spec, spec.eval_problems, spec.eval_seed)
    # room for every worked solution with a margin; a response longer than its solution is never it
    max_new_tokens = min(max(lengths) * 5 // 4, spec.model_shape["max_position_embeddings"] // 2)
    longest_prompt = max(len(formatter.ids(p)) for p in problems)
    engine = Engine(model_dir, EngineConfig(max_model_len=longest_prompt + max_new_tokens), device=device,
                    max_num_seqs=min(256, len(problems)), seed=spec.eval_seed, tokenizer=tokenizer)
    out = {"solution_len_mean": sum(lengths) / len(lengths), "eval_problems": len(problems),
           "eval_max_new_tokens": max_new_tokens}
    with get_reward("exact") as reward:
        for label, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            res = evaluate(engine, formatter, problems, reward, k=1, temperature=temperature,
                           max_new_tokens=max_new_tokens, seed=spec.eval_seed)
            out[f"{label}_accuracy"] = res["mean@1"]
            out[f"{label}_response_len"] = res["response_len_mean"]
    return out
