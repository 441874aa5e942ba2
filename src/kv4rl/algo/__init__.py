"""The learner's maths: advantages, policy losses, aggregation and log-prob utilities.

Policy losses are plug-ins: `registry.register_loss` adds one, with its own `algo.*` keys.

Pure functions over tensors; this package imports only torch and the standard library.
"""

from kv4rl.algo.advantages import (
    ADVANTAGES,
    compute_advantages,
    grpo_advantages,
    perturb_baseline,
    register_advantage,
)
from kv4rl.algo.aggregation import AGG_MODES, aggregate, batch_denominators
from kv4rl.algo.config import AdvantageConfig, AlgoConfig
from kv4rl.algo.logprobs import entropy_from_logits, k3_kl, token_logprobs
from kv4rl.algo.losses import FutureKLSettings, PPOClipSettings, combine_metrics, future_kl_credit
from kv4rl.algo.registry import LOSS_INPUTS, LOSSES, LossFn, LossInputs, LossSpec, get_loss, register_loss

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "LOSSES",
    "LOSS_INPUTS",
    "AdvantageConfig",
    "AlgoConfig",
    "FutureKLSettings",
    "LossFn",
    "LossInputs",
    "LossSpec",
    "PPOClipSettings",
    "aggregate",
    "batch_denominators",
    "combine_metrics",
    "compute_advantages",
    "entropy_from_logits",
    "future_kl_credit",
    "get_loss",
    "grpo_advantages",
    "k3_kl",
    "perturb_baseline",
    "register_advantage",
    "register_loss",
    "token_logprobs",
]
