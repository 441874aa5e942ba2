"""Evaluation: unbiased pass@k, mean@k, and the engine-driven evaluation runner."""

from kv4rl.eval.metrics import mean_at_k, pass_at_k, summarize

__all__ = ["mean_at_k", "pass_at_k", "summarize"]
