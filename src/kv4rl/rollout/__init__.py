"""Rollout orchestration: sync and quota-based partial collection, staleness control, traces."""
