"""Whether the learner's offloaded state fits this machine's host memory, checked before any model is
loaded. An 8B learner under `trainer.offload` (16 bytes of fp32 state per parameter on the host, 131
GB) was killed by the kernel's OOM killer on a 125 GiB host in its first iteration, minutes into the run
and with no error of its own (bench/RESULTS.md, seventh session); this turns that into a clear error
at the start that names the option to change."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

# fp32 bytes per parameter each option keeps in host memory (summed over the ranks on one host)
HOST_BYTES_PER_PARAM = {"offload": 16, "offload_optimizer": 8}  # weights + grads + 2 moments; 2 moments
HEADROOM = 0.9  # of the available memory: the process, the engine's loading and the page cache need some


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@lru_cache(maxsize=8)
def count_parameters(path: str | Path) -> int:
    """The parameter count of the Hugging Face model folder `path`, from its config alone (the model is
    built on the meta device: no memory, no weights read). Cached: `kv4rl train` checks before its
    engine loads and the learner checks again when it is built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_host_memory(num_params: int, *, offload: bool, offload_optimizer: bool, world_size: int = 1,
                      local_world_size: int | None = None, available: int | None = None) -> None:
    """Raise ValueError if the offloaded learner state of this host's ranks would not fit `available`
    bytes (default: MemAvailable; nothing is checked where that is unknown)."""
    option = "offload" if offload else "offload_optimizer" if offload_optimizer else None
    if option is None:
        return
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world_size is None else local_world_size
    per = HOST_BYTES_PER_PARAM[option]
    need = per * num_params * min(local, world_size) / world_size
    if need <= HEADROOM * available:
        return
    hint = ("set trainer.offload_optimizer=true instead (8 bytes per parameter on the host: "
            f"{8 * num_params * min(local, world_size) / world_size / 1e9:.1f} GB; parameters and gradients stay "
            "on the GPU)" if option == "offload" else
            "use a machine with more host memory, or several nodes to shard the learner over")
    raise ValueError(f"trainer.{option}=true keeps {per} bytes per parameter in host memory: {need / 1e9:.1f} GB for "
                     f"{num_params / 1e9:.2f}B parameters on this host, and it has {available / 1e9:.1f} GB available "
                     f"(MemAvailable; {HEADROOM:.0%} of it may be used): the kernel would kill the run in its first "
                     f"iteration. {hint[0].upper() + hint[1:]}")
