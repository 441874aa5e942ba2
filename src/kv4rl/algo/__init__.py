"""The learner's maths: advantages, policy losses, aggregation and log-prob utilities.

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
from kv4rl.algo.losses import (
    LOSSES,
    LossFn,
    LossInputs,
    combine_metrics,
    future_kl_credit,
    get_loss,
    register_loss,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "LOSSES",
    "AdvantageConfig",
    "AlgoConfig",
    "LossFn",
    "LossInputs",
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
