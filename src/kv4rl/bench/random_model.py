"""Randomly initialised models with a real model's shape, for benchmarks that need no trained weights.

KV storage and the fidelity of a quantized cache depend on the attention shape (head_dim, KV heads,
layers) and the vocabulary, which a random-init model reproduces exactly; its outputs are close to
uniform, so distribution distances measured on it are small in absolute terms. The folder is an
ordinary HF checkpoint (weights saved in bf16, as the released model) plus the char tokenizer of the
embedded task, so `kv4rl bench` can feed it the embedded prompts; the tokenizer's ids are a subset
of the model's vocabulary. `random_decoder` builds the engine's own decoder directly on a device, and
`random_hf_qwen3` a transformers model for baselines, both without touching the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from kv4rl.file_modes import honour_umask
from kv4rl.graceful_stop import cleanup_on_sigterm
from kv4rl.models.args import ModelArgs
from kv4rl.models.cache_install import clear_abandoned
from kv4rl.models.decoder import Decoder
from kv4rl.models.layers import RMSNorm

_INIT_STD = 0.02  # transformers' Qwen3Config.initializer_range

_QWEN3_COMMON = {
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict:
    return {**_QWEN3_COMMON, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "tie_word_embeddings": tie}


# From the released config.json files of Qwen/Qwen3-{0.6B,1.7B,4B,8B}.
QWEN3_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tie=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tie=False),
}
# Small enough for CPU tests of the commands that take a shape; not a released model.
TEST_SHAPES: dict[str, dict] = {
    "qwen3-tiny": {**_QWEN3_COMMON, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "max_position_embeddings": 512, "tie_word_embeddings": True},
}


def _shape(name: str) -> dict:
    shapes = {**QWEN3_SHAPES, **TEST_SHAPES}
    if name not in shapes:
        raise ValueError(f"unknown model shape '{name}' (known: {', '.join(shapes)})")
    return dict(shapes[name])


def qwen3_args(shape: str, num_layers: int | None = None) -> ModelArgs:
    """The engine's ModelArgs for `shape`, read as the released config.json would be (no EOS: random
    models have no meaningful stop token)."""
    config = {"model_type": "qwen3", **_shape(shape), "eos_token_id": None}
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return ModelArgs.from_hf_config(config)


def _empty_decoder(args: ModelArgs, device: torch.device, dtype: torch.dtype, tp=None) -> Decoder:
    """Parameters allocated on `device` but not initialised (built on meta: no init cost)."""
    with torch.device("meta"):
        model = Decoder(args, dtype=dtype, tp=tp)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.build_cache(device)
    return model


@torch.no_grad()
def random_decoder(shape: str, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0, num_layers: int | None = None, tp=None) -> Decoder:
    """The engine's decoder with `shape`, random-init in place on `device` (no disk, no transformers).

    Initialised as transformers initialises Qwen3 (normal std 0.02 for linears and embeddings, RMSNorm
    weights one), from a generator on the device, so an 8B model builds in seconds on a GPU; the same
    seed on the same device type gives the same weights. With `tp` it is this rank's shard, drawn
    independently (a speed benchmark needs the shapes, not one consistent model).
    """
    device = torch.device(device)
    model = _empty_decoder(qwen3_args(shape, num_layers), device, dtype, tp)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Linear | nn.Embedding):
            if module is model.lm_head and model.args.tie_word_embeddings:
                continue  # the embedding, drawn once
            module.weight.normal_(0.0, _INIT_STD, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return model.eval()


def random_hf_qwen3(shape: str, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0, pad_token_id: int = 0):
    """A transformers Qwen3ForCausalLM with `shape`, random-init by transformers on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**_shape(shape), eos_token_id=None, bos_token_id=None, pad_token_id=pad_token_id)
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


@torch.no_grad()
def decoder_from_hf(hf_model) -> Decoder:
    """The engine's decoder holding a copy of an in-memory transformers model's weights, on its device."""
    weight = next(hf_model.parameters())
    args = ModelArgs.from_hf_config(hf_model.config.to_dict())
    model = _empty_decoder(args, weight.device, weight.dtype)
    model.load_hf_state_dict(hf_model.state_dict())
    return model.eval()


def make_random_qwen3(out_dir: str | Path, shape: str = "qwen3-0.6b", *, num_layers: int | None = None,
                      seed: int = 0, device: str | torch.device = "cpu") -> Path:
    """Write a random-init Qwen3 of `shape` (optionally with only `num_layers` layers) to `out_dir`.

    `device="cuda"` draws the weights there, in bf16: the 8B shape took 189 s on the H200 machine's CPU
    (fp32 init of 8B parameters, then a cast), most of a device call. The CPU and the GPU draw different
    numbers from the same seed, so the two are cached under different names (`random_model_dir`)."""
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
    device = torch.device(device)
    if device.type == "cpu":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
        model = model.to(torch.bfloat16)
    else:
        with torch.random.fork_rng(devices=[device]), torch.device(device):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    honour_umask(*out_dir.glob("*.safetensors"))  # safetensors writes them 0600
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def random_model_dir(shape: str, num_layers: int | None = None, seed: int = 0,
                     cache_dir: str | Path | None = None, device: str | torch.device = "cpu") -> Path:
    """A cached `make_random_qwen3` folder under the kv4rl cache, built on first use (on `device`)."""
    from kv4rl.models.tiny import default_cache_dir

    layers = num_layers or _shape(shape)["num_hidden_layers"]
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    built_on = torch.device(device).type
    final = parent / (f"random-{shape}-L{layers}-seed{seed}" + ("" if built_on == "cpu" else f"-{built_on}"))
    if final.is_dir():  # only ever renamed into place once complete
        return final
    parent.mkdir(parents=True, exist_ok=True)
    clear_abandoned(parent, final.name)
    with cleanup_on_sigterm():  # a SIGTERM mid-build removes the staging folder (GBs) too
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            make_random_qwen3(staging, shape, num_layers=layers, seed=seed, device=device)
            honour_umask(staging)  # mkdtemp made it private; others read the cache
            try:
                os.replace(staging, final)
            except OSError:
                if not final.is_dir():  # else another process installed the same model first: keep its copy
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final
