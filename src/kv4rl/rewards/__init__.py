"""Reward functions scored per batch; importing this package registers `math_verify`, `exact` and
`boxed_format`."""

from kv4rl.rewards.base import (
    Reward,
    RewardFn,
    RewardResult,
    call_reward,
    extract_boxed,
    get_reward,
    register_reward,
    registered_rewards,
)
from kv4rl.rewards.combined import (
    BoxedFormatReward,
    WeightedRewards,
    reward_metrics,
    score_responses,
    summed_reward_stats,
    verifier_name,
    with_overlong_penalty,
)
from kv4rl.rewards.math import ExactReward, MathVerifyReward, exact_match, verify_answer
from kv4rl.rewards.verl_score import VerlScore

__all__ = [
    "BoxedFormatReward",
    "ExactReward",
    "MathVerifyReward",
    "Reward",
    "RewardFn",
    "RewardResult",
    "VerlScore",
    "call_reward",
    "exact_match",
    "extract_boxed",
    "get_reward",
    "register_reward",
    "registered_rewards",
    "verify_answer",
    "WeightedRewards",
    "reward_metrics",
    "score_responses",
    "summed_reward_stats",
    "verifier_name",
    "with_overlong_penalty",
]
