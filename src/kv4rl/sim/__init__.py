"""Small simulations that reproduce the method's arguments (docs/simulations.md) without a model."""

from kv4rl.sim.clip_bias import clip_bias, closed_form, plot, sweep

__all__ = ["clip_bias", "closed_form", "plot", "sweep"]
