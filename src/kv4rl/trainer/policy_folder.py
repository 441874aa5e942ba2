"""The learner's policy written as a Hugging Face folder (safetensors) that transformers loads as it would
the model the run started from."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_policy_folder(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor]) -> None:
    """`model.save_pretrained` of the full weights `state`, with what training changed put back."""
    if getattr(model.config, "tie_word_embeddings", False):  # gathered from shards, the tied head is a copy
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # of its own: ~1.5 GB at 4B
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    config = Path(path) / "config.json"  # FSDP2 renames the class; older transformers kept the prefix
    data = json.loads(config.read_text())
    names = [a.removeprefix("FSDP") for a in data.get("architectures") or []]
    # the learner turns the KV cache off for training; a forward of the saved model returned none
    if names != data.get("architectures") or data.get("use_cache") is False:
        data["architectures"] = names
        data["use_cache"] = True
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
