"""The BF16 learner: policy log-probs, the registered policy loss, backward, clip, AdamW.

Master weights and AdamW state are fp32; on CUDA the forward runs under bf16 autocast, so the
compute is BF16 while optimizer arithmetic keeps full precision. The engine receives the weights
through `state_dict()` after every update. The loss says which optional inputs it reads
(`LossSpec.inputs`); the learner computes only those: a frozen copy of the initial policy is loaded
only for `ref_logprobs` (the built-in losses log the k3 reference KL and add it when
`algo.kl_ref_coef > 0`), and the policy's own pre-update log-probs only for `old_logprobs`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import entropy_from_logits, k3_kl, token_logprobs
from kv4rl.algo.losses import combine_metrics
from kv4rl.algo.registry import LossInputs, get_loss
from kv4rl.trainer.batch import TrainBatch

FROM_BATCH = frozenset({"behavior_logprobs", "versions"})  # loss inputs a TrainBatch already holds


def load_hf_model(path: str | Path, device: torch.device, grad_checkpointing: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if grad_checkpointing:  # transformers renamed the switch; 5.17 has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    model.config.use_cache = False
    return model.train()  # from_pretrained returns eval mode, which also turns checkpointing off


class Learner:
    def __init__(self, policy_path: str | Path, ref_path: str | Path | None, *, algo: AlgoConfig,
                 lr: float, weight_decay: float, betas: tuple[float, float], grad_clip: float,
                 micro_batch_size: int, updates_per_batch: int, temperature: float,
                 device: torch.device, grad_checkpointing: bool = False):
        self.device = device
        self.algo = algo
        self.loss_fn = get_loss(algo.loss)
        self.loss_inputs = self.loss_fn.inputs(algo)  # the optional LossInputs fields to fill
        self.temperature = temperature
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.updates_per_batch = updates_per_batch
        self.model = load_hf_model(policy_path, device, grad_checkpointing)
        self.ref_model = None
        if ref_path is not None and "ref_logprobs" in self.loss_inputs:
            self.ref_model = load_hf_model(ref_path, device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, model, mb: TrainBatch, with_entropy: bool = False):
        with self._autocast():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        logp = token_logprobs(logits, mb.input_ids[:, 1:], self.temperature)
        ent = entropy_from_logits(logits.detach(), self.temperature) if with_entropy else None
        return logp, ent

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        out = [self._forward(model, batch.select(slice(i, i + self.micro_batch_size)))[0]
               for i in range(0, len(batch), self.micro_batch_size)]
        return torch.cat(out)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs [B, L-1] of `batch` under the current weights, as the first update sees
        them (no grad; used by mismatch attribution)."""
        return self._logprobs(self.model, batch.to(self.device))

    def _before_update_inputs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The loss inputs that cost a forward pass over the whole batch before its first update."""
        out = {}
        if "ref_logprobs" in self.loss_inputs and self.ref_model is not None:
            out["ref_logprobs"] = self._logprobs(self.ref_model, batch)
        if "old_logprobs" in self.loss_inputs:
            out["old_logprobs"] = self._logprobs(self.model, batch)
        return out

    def step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """One learner batch: `updates_per_batch` optimizer steps over contiguous mini-batches."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        batch = batch.to(self.device)
        mask = batch.response_mask
        before_update = self._before_update_inputs(batch)
        parts: list[tuple[dict[str, float], float]] = []  # per micro-batch, merged by combine_metrics
        rows = torch.arange(len(batch), device=self.device).chunk(self.updates_per_batch)
        for update, mini_rows in enumerate(rows):
            mini = batch.select(mini_rows)
            num_tokens, num_seqs = mini.num_tokens, float((mini.response_mask.sum(1) > 0).sum())
            self.optimizer.zero_grad(set_to_none=True)
            for mb_rows in mini_rows.split(self.micro_batch_size):
                mb = batch.select(mb_rows)
                logp, ent = self._forward(self.model, mb, with_entropy=True)
                optional = {name: getattr(mb, name) for name in FROM_BATCH & self.loss_inputs}
                optional.update({name: values[mb_rows] for name, values in before_update.items()})
                inp = LossInputs(logprobs=logp, advantages=mb.advantages, mask=mb.response_mask,
                                 num_tokens=num_tokens, num_seqs=num_seqs, **optional)
                loss, metrics = self.loss_fn(inp, self.algo)
                loss.backward()
                metrics = dict(metrics, loss=float(loss.detach()) * num_tokens / max(mb.num_tokens, 1.0))
                metrics.update(self._token_stats(logp.detach(), ent, mb, first=update == 0))
                parts.append((metrics, mb.num_tokens))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            parts.append(({"grad_norm": float(grad_norm)}, 1.0))
            self.optimizer.step()
        out = combine_metrics(parts)
        out["num_tokens"] = float(mask.sum())
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _token_stats(self, logp, ent, mb: TrainBatch, first: bool) -> dict[str, float]:
        """Entropy and engine-vs-learner mismatch (measured before any update of this batch)."""
        m = mb.response_mask
        n = m.sum().clamp(min=1)
        stats = {"entropy": float((ent * m).sum() / n)}
        if first:
            diff = (logp - mb.behavior_logprobs) * m
            stats["mismatch_k3"] = float((k3_kl(mb.behavior_logprobs, logp) * m).sum() / n)
            stats["mismatch_abs_mean"] = float(diff.abs().sum() / n)
            stats["mismatch_absmax"] = float(diff.abs().max())
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # ---- checkpointing ----------------------------------------------------------------------
    def save_pretrained(self, path: Path) -> None:
        """The policy as a Hugging Face folder (safetensors), loadable by transformers."""
        self.model.save_pretrained(path, safe_serialization=True)

    def checkpoint_state(self) -> dict:
        """What a resume needs beyond the weights: the AdamW moments and step counts."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
