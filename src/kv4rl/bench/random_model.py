"""Randomly initialised checkpoints with a real model's shape, for benchmarks that need no trained weights.

KV storage and the fidelity of a quantized cache depend on the attention shape (head_dim, KV heads,
layers) and the vocabulary, which a random-init model reproduces exactly; its outputs are close to
uniform, so distribution distances measured on it are small in absolute terms. The folder is an
ordinary HF checkpoint (weights saved in bf16, as the released model) plus the char tokenizer of the
embedded task, so `kv4rl bench` can feed it the embedded prompts; the tokenizer's ids are a subset
of the model's vocabulary.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

# From the released config.json of Qwen/Qwen3-0.6B.
QWEN3_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


def _shape(name: str) -> dict:
    if name not in QWEN3_SHAPES:
        raise ValueError(f"--random-init: unknown shape '{name}' (known: {', '.join(QWEN3_SHAPES)})")
    return dict(QWEN3_SHAPES[name])


def make_random_qwen3(out_dir: str | Path, shape: str = "qwen3-0.6b", *, num_layers: int | None = None,
                      seed: int = 0) -> Path:
    """Write a random-init Qwen3 of `shape` (optionally with only `num_layers` layers) to `out_dir`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kv4rl.data.char_tokenizer import build_char_tokenizer

    config_kwargs = _shape(shape)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--random-layers must be >= 1, got {num_layers}")
        config_kwargs["num_hidden_layers"] = num_layers
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(out_dir)
    config = Qwen3Config(**config_kwargs, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def random_model_dir(shape: str, num_layers: int | None = None, seed: int = 0,
                     cache_dir: str | Path | None = None) -> Path:
    """A cached `make_random_qwen3` folder under the kv4rl cache, built on first use."""
    from kv4rl.models.tiny import default_cache_dir

    layers = num_layers or _shape(shape)["num_hidden_layers"]
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = parent / f"random-{shape}-L{layers}-seed{seed}"
    if final.is_dir():  # only ever renamed into place once complete
        return final
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        make_random_qwen3(staging, shape, num_layers=layers, seed=seed)
        if not final.exists():
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
