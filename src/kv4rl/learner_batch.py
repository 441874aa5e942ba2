"""From a batch's scored responses to the learner's batch: a KL penalty in the rewards (`advantage.kl_reward_coef`,
the learner's reference forward, whose log-probs the update reuses), the advantages (over every rank's responses
where the estimator reads the whole batch), and the padded `TrainBatch`.

verl's `reinforce_plus_plus` with a KL in the reward gives each token its own advantage (its return: the score less
the KL of the tokens from it on); every other estimator gives a response one, which the batch spreads over its
tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kv4rl.algo.advantages import compute_advantages, flat_group_metrics, needs_whole_batch, noise_key
from kv4rl.algo.kl_reward import KLRewardCoef, kl_penalty_of, kl_reward_tokens, row_mean_kl
from kv4rl.algo.token_advantages import optimal_token_baseline, reinforce_pp_token_advantages
from kv4rl.config import RunConfig
from kv4rl.distributed import current, gather_objects
from kv4rl.trainer.batch import TrainBatch, build_batch, untrained_rows, with_advantages


@dataclass
class LearnerBatch:
    batch: TrainBatch
    given: dict[str, Tensor]  # log-probs the KL reward took, for the update to reuse
    rewards: Tensor  # the trained scores, less the KL penalty where there is one
    metrics: dict[str, float]  # the KL reward's and the advantages'


def learner_batch(cfg: RunConfig, learner, rows: tuple, scores: Tensor, group_size: int, group_indices: list[int],
                  iteration: int, pad_id: int, truncated: list[bool] | None,
                  kl_coef: KLRewardCoef | None = None, baselines: Tensor | None = None) -> LearnerBatch:
    """`rows`: (prompts, responses, behaviour log-probs, versions) of every response of this rank's groups, in
    group order; `scores` their rewards (float64). `kl_coef`: the run's β of a KL in the reward, updated here after
    the batch when it adapts (the config's fixed β when None). `baselines`: ReMax's greedy score per group."""
    a = cfg.advantage
    given: dict[str, Tensor] = {}
    metrics: dict[str, float] = {}
    rewards = scores
    if a.kl_reward_coef > 0:
        kl_coef = kl_coef if kl_coef is not None else KLRewardCoef.from_config(a)
        beta = kl_coef.value
        # every response's tokens, truncated ones too: they count in their group's advantages with their penalty
        whole = build_batch(*rows, [0.0] * len(scores), pad_id)
        given, kl = reward_kl(cfg, learner, whole)
        penalty, metrics = kl_penalty_of(kl, whole.response_mask, beta)
        metrics["kl_reward/coef"] = beta
        _adapt(kl_coef, kl, whole.response_mask)
        rewards = scores - penalty
        if a.estimator == "reinforce_plus_plus":
            return _token_returns(scores, rewards, kl, beta, whole, given, metrics, group_size, truncated)
    if a.estimator == "optimal_token_baseline":
        return _optimal_token_baseline(cfg, learner, rows, scores, group_size, pad_id, truncated)
    keys = [noise_key(cfg.seed, iteration, g) for g in group_indices]  # the same noise on any rank
    lengths = torch.tensor([len(r) for r in rows[1]], dtype=torch.float64)
    everyone = everyone_lengths = None
    if needs_whole_batch(a) and current().world > 1:  # every rank's rewards and token counts (ranks hold disjoint
        # groups, tensor-parallel ones too), in rank order
        parts = gather_objects((rewards.tolist(), lengths.tolist()))
        everyone = torch.tensor([x for scores, _ in parts for x in scores], dtype=torch.float64)
        everyone_lengths = torch.tensor([n for _, counts in parts for n in counts], dtype=torch.float64)
    over_ranks = _sum_over_ranks if current().world > 1 else None  # advantage.whiten's sums
    advantages, adv_metrics = compute_advantages(rewards, group_size, a, group_keys=keys, batch_rewards=everyone,
                                                 lengths=lengths, batch_lengths=everyone_lengths, over_ranks=over_ranks,
                                                 baselines=baselines)
    untrained = untrained_rows(truncated, advantages.tolist(), cfg.trainer.mask_zero_advantage)
    batch = (with_advantages(whole, advantages, untrained) if a.kl_reward_coef > 0
             else build_batch(*rows, advantages.tolist(), pad_id, untrained))
    return LearnerBatch(batch, given, rewards, {**metrics, **adv_metrics})


def reward_kl(cfg: RunConfig, learner, batch: TrainBatch) -> tuple[dict[str, Tensor], Tensor]:
    """(the log-probs taken, for the update to reuse; each token's KL estimate [B, T] float64). π_old is the learner's
    recomputed log-probs with `algo.old_logprob=recompute`, else the engine's μ."""
    given = {"ref_logprobs": learner.logprobs(batch, reference=True)}
    if cfg.algo.loss == "ppo_clip" and cfg.algo.old_logprob == "recompute":
        given["old_logprobs"] = learner.logprobs(batch)
    old = given.get("old_logprobs", batch.behavior_logprobs)
    kl = kl_reward_tokens(old.cpu(), given["ref_logprobs"].cpu(), batch.response_mask, cfg.advantage.kl_reward_type)
    return given, kl


def _adapt(kl_coef: KLRewardCoef, kl: Tensor, mask: Tensor) -> None:
    """Move an adaptive β by the KL of every rank's responses (each response's mean kl_t, then their mean, as
    verl's controller reads it), so that every rank keeps the same β."""
    if kl_coef.control != "adaptive":
        return
    row_means = row_mean_kl(kl, mask)
    total, responses = float(row_means.sum()), len(row_means)
    if current().world > 1:
        parts = gather_objects((total, responses))
        total, responses = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if responses:
        kl_coef.update(total / responses, responses)


def _sum_over_ranks(x: Tensor) -> Tensor:
    """`x` summed over the job's ranks, in rank order (the same float64 sum on every rank)."""
    return torch.stack([torch.as_tensor(part, dtype=torch.float64) for part in gather_objects(x.tolist())]).sum(0)


def _optimal_token_baseline(cfg: RunConfig, learner, rows: tuple, scores: Tensor, group_size: int, pad_id: int,
                            truncated: list[bool] | None) -> LearnerBatch:
    """verl's optimal token baseline: π_old's log-probs and Σπ² of every token from one learner forward, the
    advantages per token."""
    whole = build_batch(*rows, [0.0] * len(scores), pad_id)
    logp, spsq = learner.logprobs_and_sum_pi_squared(whole)
    valid = whole.response_mask.bool()
    lengths = valid.sum(1)
    width = int(lengths.max()) if len(lengths) else 0
    aligned = torch.arange(width, device=valid.device)[None] < lengths[:, None]  # each response from its first token
    inputs = []
    for full in (logp, spsq):
        out = torch.zeros(aligned.shape, dtype=torch.float64, device=valid.device)
        out[aligned] = full[valid].double()
        inputs.append(out)
    token_adv = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    token_adv[valid] = optimal_token_baseline(scores.to(valid.device), *inputs, aligned, group_size)[aligned]
    batch = with_advantages(whole, token_adv, truncated)
    return LearnerBatch(batch, {}, scores, {**flat_group_metrics(scores, group_size), **_token_adv_metrics(
        token_adv[valid], scores)})


def _token_adv_metrics(tokens: Tensor, rewards: Tensor) -> dict[str, float]:
    """The advantages' statistics over every rank's tokens, so each rank logs the batch's (ranks' rows merge as equal
    shares, their tokens not), and the rewards'."""
    largest = float(tokens.abs().max()) if len(tokens) else 0.0
    parts = gather_objects((len(tokens), float(tokens.sum()), float((tokens ** 2).sum()), largest))
    count, total, squares = (sum(part[k] for part in parts) for k in range(3))
    mean = total / count
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(correction=0)), "adv_mean": mean,
            "adv_std": max(squares / count - mean * mean, 0.0) ** 0.5, "adv_absmax": max(part[3] for part in parts)}


def _token_returns(scores: Tensor, rewards: Tensor, kl: Tensor, beta: float, whole: TrainBatch,
                   given: dict[str, Tensor], metrics: dict[str, float], group_size: int,
                   truncated: list[bool] | None) -> LearnerBatch:
    """verl's per-token REINFORCE++ returns (`reinforce_pp_token_advantages`), whitened over every rank's tokens."""
    valid = whole.response_mask.bool()
    over_ranks = _sum_over_ranks if current().world > 1 else None
    token_adv = reinforce_pp_token_advantages(scores, kl, valid, beta, over_ranks)
    batch = with_advantages(whole, token_adv, truncated)
    adv_metrics = {**flat_group_metrics(rewards, group_size), **_token_adv_metrics(token_adv[valid], rewards)}
    return LearnerBatch(batch, given, rewards, {**metrics, **adv_metrics})
