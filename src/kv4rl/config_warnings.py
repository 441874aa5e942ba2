"""Warnings about settings a run accepts but that change nothing, or change something a user may not expect
(a key another setting makes unread, a sampler truncation that moves the importance ratio, a lag past the run's
end): said once when the config is validated, never refused."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv4rl.config import RunConfig

log = logging.getLogger("kv4rl.config")


def log_unread_settings(cfg: RunConfig) -> None:
    """One warning line for each such setting of the validated `cfg` (the logger is the config's, as before)."""
    for line in cfg.algo.ignored_keys():
        log.warning(line)
    adv = cfg.advantage
    if adv.estimator != "grpo":  # GRPO's std keys, set for an estimator that does not read them
        divides = "divides by its own std (the batch's tokens')" if adv.estimator.startswith("reinforce") else \
            "divides by the group's std" if adv.estimator == "grpo_passk" else "divides by no std"
        for key, what, readers in (("advantage.std_scope=batch", adv.std_scope == "batch", ("grpo",)),
                                   ("advantage.normalize_std=false", not adv.normalize_std,
                                    ("grpo", "grpo_passk"))):
            if what and adv.estimator not in readers:
                log.warning("%s is read by advantage.estimator=%s only; advantage.estimator=%s %s, so it "
                            "changes nothing", key, " and ".join(readers), adv.estimator, divides)
    elif cfg.advantage.std_scope == "batch" and not cfg.advantage.normalize_std:
        log.warning("advantage.std_scope=batch picks the std that advantage.normalize_std divides by; with "
                    "advantage.normalize_std=false nothing is divided and it changes nothing")
    group_std = (adv.estimator == "grpo" and adv.normalize_std and adv.std_scope == "group") \
        or adv.estimator == "grpo_passk"
    if cfg.reward.aggregation == "normalize_then_sum" and group_std:
        log.warning("reward.aggregation=normalize_then_sum with %s divides each group's summed score by that group's "
                    "std again; TRL's GDPO divides it by the whole batch's (advantage.estimator=grpo, "
                    "advantage.std_scope=batch)", "advantage.std_scope=group" if adv.estimator == "grpo"
                    else "advantage.estimator=grpo_passk")
    if cfg.trainer.lr_schedule == "constant" and cfg.trainer.min_lr_ratio != 0:
        log.warning("trainer.min_lr_ratio=%g belongs to trainer.lr_schedule=linear or cosine; the constant "
                    "schedule ignores it", cfg.trainer.min_lr_ratio)
    if cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0 or cfg.rollout.min_p > 0:
        ratio = ("PPO's ratio (algo.old_logprob=behavior)" if cfg.algo.loss == "ppo_clip"
                 and cfg.algo.old_logprob == "behavior" else "the behaviour log-ratio")
        log.warning("rollout.top_p=%g, rollout.top_k=%d, rollout.min_p=%g truncate what the engine samples: it "
                    "reports log-probs of "
                    "the truncated distribution, the learner of the whole softmax(logits / temperature), so "
                    "%s starts below 1 on every kept token by the mass the truncation kept (mismatch_* in "
                    "metrics.jsonl shows it; top_p=1, top_k=0, min_p=0 keeps it at 1)",
                    cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.min_p, ratio)
    if cfg.staleness.lag >= cfg.trainer.iterations:
        split = cfg.rollout.placement == "split"  # its engines' batches are not checkpointed: dropped
        log.warning("staleness.lag=%d collects %d batches ahead of the learner: with trainer.iterations=%d the "
                    "run collects %s%d and trains on %d (%s)",
                    cfg.staleness.lag, cfg.staleness.lag, cfg.trainer.iterations, "up to " if split else "",
                    cfg.trainer.iterations + cfg.staleness.lag, cfg.trainer.iterations,
                    "the rest are dropped; a longer --resume samples them again" if split else
                    "the rest wait in its checkpoint for a longer --resume")
