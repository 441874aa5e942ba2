"""Disaggregated asynchronous training (`rollout.placement: split`): engines on some ranks, the learner on the others."""
