"""The learner's policy model: loaded from a Hugging Face folder (or taken in memory), made ready to
train (activation checkpointing, no KV cache, train mode), and sharded with FSDP2 per decoder layer
and at the root, on a process group of world size 1 unless the caller (torchrun) made one."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM


def ensure_process_group(device: torch.device) -> None:
    """A world-size-1 process group unless the caller (e.g. torchrun) already made one.

    The store lives in this process (no TCP port or file), so parallel runs and tests never clash.
    """
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def load_hf_model(path: str | Path, device: torch.device, grad_checkpointing: bool = False,
                  dtype: torch.dtype = torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return prepare_policy(model, grad_checkpointing)


def load_reference(ref: str | Path | nn.Module, device: torch.device) -> nn.Module:
    """The frozen reference policy (a folder, or a model as it is): bf16 on CUDA, fp32 on the CPU, no KV cache, no
    gradients."""
    if not isinstance(ref, nn.Module):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ref = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype).to(device)
    ref.config.use_cache = False
    return ref.eval().requires_grad_(False)


def prepare_policy(model, grad_checkpointing: bool = False):
    if grad_checkpointing:  # transformers renamed the switch; 5.17 has only the old name
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable()  # non-reentrant by default
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()  # from_pretrained returns eval mode, which also turns checkpointing off


def _decoder_layers(model) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layer list to shard (model.get_decoder().layers)")
    return layers


def shard_policy(model, device: torch.device, offload: bool = False, group: dist.ProcessGroup | None = None):
    """FSDP2: each decoder layer is a unit, then the root (embeddings, final norm, LM head). `group`: the
    ranks that shard the learner (default: the whole job; a split run's learner ranks otherwise)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    ensure_process_group(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the mesh places each rank on the current device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if group is None \
        else DeviceMesh.from_group(group, device.type)
    kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
