"""Reward functions scored per batch; importing this package registers `math_verify` and `exact`."""

from kv4rl.rewards.base import (
    Reward,
    RewardFn,
    RewardResult,
    extract_boxed,
    get_reward,
    register_reward,
    registered_rewards,
)
from kv4rl.rewards.math import ExactReward, MathVerifyReward, exact_match, verify_answer

__all__ = [
    "ExactReward",
    "MathVerifyReward",
    "Reward",
    "RewardFn",
    "RewardResult",
    "exact_match",
    "extract_boxed",
    "get_reward",
    "register_reward",
    "registered_rewards",
    "verify_answer",
]
