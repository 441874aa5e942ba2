"""kv4rl: RL post-training with cheap low-precision rollouts and a learner that tolerates them."""

__version__ = "0.1.0"
