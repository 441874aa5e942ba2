"""A KL penalty in the reward (docs/objectives.md, "KL in the reward"; verl's use_kl_in_reward, TRL's RLOOTrainer):
each response's score less β times the sum over its tokens of a KL estimate between the policy that sampled the batch
and the frozen reference, before the advantages are taken from it. β is fixed, or moved toward a target KL by verl's
(and Ziegler et al.'s) adaptive controller, `KLRewardCoef`."""

from __future__ import annotations

import torch
from torch import Tensor

from kv4rl.algo.logprobs import LOG_RATIO_LIMIT, ref_kl_terms


def kl_reward_tokens(old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str) -> Tensor:
    """[B, T] float64: each `mask`ed token's `kind` KL estimate between π_old and the reference (0 elsewhere), the
    log-ratio held at ±80 (`algo.logprobs.ref_kl_terms`: k1 = log π_old − log π_ref, verl's default `kl`)."""
    valid = mask.bool()
    old, ref = old_logprobs.double(), ref_logprobs.double().to(old_logprobs.device)
    held = torch.clamp(old, ref - LOG_RATIO_LIMIT, ref + LOG_RATIO_LIMIT)
    return torch.where(valid, ref_kl_terms(held, ref, kind), 0.0)


def kl_reward_penalty(old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, coef: float,
                      kind: str) -> tuple[Tensor, dict[str, float]]:
    """(penalty [B] float64, metrics): `coef · Σ_t kl_t` over each row's `mask`ed tokens, kl_t the `kind` estimate
    (`algo.logprobs.ref_kl_terms`: k1 = log π_old − log π_ref, verl's default `kl`) with the log-ratio held at ±80.
    Metrics over the rows that have a token, verl's way (so ranks of equal row counts average to one process's):
    `kl_reward/token_mean` (each row's mean kl_t, then their mean: verl's actor/reward_kl_penalty) and
    `kl_reward/penalty_mean`. `k3` has no cap here (verl's low_var_kl holds each token's at 10)."""
    return kl_penalty_of(kl_reward_tokens(old_logprobs, ref_logprobs, mask, kind), mask, coef)


def kl_penalty_of(kl: Tensor, mask: Tensor, coef: float) -> tuple[Tensor, dict[str, float]]:
    """`kl_reward_penalty` from the tokens' KL estimates `kl` ([B, T], 0 off `mask`)."""
    penalty = coef * kl.sum(-1)
    row_means = row_mean_kl(kl, mask)
    return penalty, {"kl_reward/token_mean": float(row_means.mean()) if len(row_means) else 0.0,
                     "kl_reward/penalty_mean": float(penalty.mean()) if len(penalty) else 0.0}


def row_mean_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Each response's mean kl_t over its `mask`ed tokens, for the rows that have one (verl's `masked_mean` per row:
    the KL its logs and its adaptive controller read)."""
    counts = mask.bool().sum(-1)
    rows = counts > 0
    return kl.sum(-1)[rows] / counts[rows]


class KLRewardCoef:
    """β of the KL in the reward (`advantage.kl_reward_coef`), the run's own state: fixed, or with
    `advantage.kl_reward_control=adaptive` moved after each batch by verl's adaptive controller (Ziegler et al. 2019):
    β ← β · (1 + clip(KL / target − 1, ±0.2) · n / horizon), KL the batch's mean of each response's mean kl_t and n
    its responses. The batch is penalised with the β before its own update, as verl's is; checkpoints keep β."""

    def __init__(self, coef: float, control: str = "fixed", target: float = 0.1, horizon: float = 10000.0):
        self.value, self.control, self.target, self.horizon = float(coef), control, float(target), float(horizon)
        self.start = self.value  # the config's β, to tell a resume that changed it from one that did not

    @classmethod
    def from_config(cls, advantage) -> KLRewardCoef:
        return cls(advantage.kl_reward_coef, advantage.kl_reward_control, advantage.kl_reward_target,
                   advantage.kl_reward_horizon)

    def update(self, mean_kl: float, responses: int) -> None:
        """After a batch of `responses` responses whose mean per-token KL (each response's mean, then theirs) was
        `mean_kl`; a fixed β stays."""
        if self.control != "adaptive" or responses <= 0:
            return
        error = min(max(mean_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * responses / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "control": self.control, "start": self.start}

    def load_state_dict(self, state: dict) -> str | None:
        """A checkpoint's β, where this run adapts it too from the same `kl_reward_coef` (a fixed β is the config's,
        also on resume; a `kl_reward_coef` changed at the resume starts β again from it). Returns a line saying
        which β a resume that changed the settings goes on with, or None."""
        if self.control != "adaptive" or state.get("control") != "adaptive":
            return None
        if state.get("start", self.start) != self.start:
            return (f"advantage.kl_reward_coef changed at the resume ({state.get('start')} -> {self.start}): the "
                    f"adaptive β starts again from {self.start}, not from the checkpoint's {state['value']:.6g}")
        self.value = float(state["value"])
        return None
