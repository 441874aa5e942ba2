"""The two transformers-side policies of the correction-variance measurement (`kv4rl.sim.correction_variance`):
π's log-probs of given responses by teacher forcing, as the learner evaluates them, and the stale behaviour
`stale:K`, the checkpoint after K AdamW steps on the task's reference responses."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor

from kv4rl.algo.logprobs import token_logprobs
from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.synthetic import target_text
from kv4rl.data.types import Problem
from kv4rl.telemetry.progress import StageReport


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _right_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
    return ids.to(device), attention.to(device)


@torch.no_grad()
def teacher_forced_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
    micro_batch: int = 8, progress: StageReport | None = None,
) -> tuple[Tensor, Tensor]:
    """log π(response token | prompt, earlier response) at temperature τ: (`[B, T]` float64, mask)."""
    device = next(model.parameters()).device
    width = max(len(r) for r in responses)
    logprobs = torch.zeros((len(responses), width), dtype=torch.float64)
    mask = torch.zeros((len(responses), width), dtype=torch.bool)
    for start in range(0, len(responses), micro_batch):
        rows = range(start, min(start + micro_batch, len(responses)))
        ids, attention = _right_padded([prompts[i] + responses[i] for i in rows], 0, device)
        with _autocast(device):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        shifted = token_logprobs(logits, ids[:, 1:], temperature).double().cpu()
        for local, i in enumerate(rows):
            first = len(prompts[i]) - 1  # logits at position p-1 predict response token 0
            logprobs[i, : len(responses[i])] = shifted[local, first : first + len(responses[i])]
            mask[i, : len(responses[i])] = True
        if progress is not None:
            progress(f"teacher-forcing {len(responses)} responses through π", rows.stop, len(responses))
    return logprobs, mask


def supervised_batch(
    formatter: PromptFormatter, problems: list[Problem], device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, labels) for `prompt + \\boxed{answer} + EOS`, loss on the response."""
    tokenizer = formatter.tokenizer
    if tokenizer.eos_token_id is None:
        raise ValueError("stale:K needs a tokenizer with an EOS token to end the reference responses")
    rows, prompt_lens = [], []
    for problem in problems:
        prompt = formatter.ids(problem)
        response = tokenizer.encode(target_text(problem.answer), add_special_tokens=False)
        rows.append(prompt + response + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, attention = _right_padded(rows, pad_id, device)
    labels = torch.where(attention.bool(), ids, -100)
    for i, prompt_len in enumerate(prompt_lens):
        labels[i, :prompt_len] = -100
    return ids, attention, labels


def stale_policy(model, batches: list[list[Problem]], formatter: PromptFormatter, lr: float,
                 progress: StageReport | None = None):
    """A copy of `model` after one AdamW step per batch (see the module docstring)."""
    moved = copy.deepcopy(model).requires_grad_(True)
    device = next(moved.parameters()).device
    optimizer = torch.optim.AdamW(moved.parameters(), lr=lr, weight_decay=0.0)
    for step, problems in enumerate(batches):
        ids, attention, labels = supervised_batch(formatter, problems, device)
        with _autocast(device):
            loss = moved(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if progress is not None:
            progress(f"training μ = stale:{len(batches)}", step + 1, len(batches))
    moved.requires_grad_(False)
    return moved
