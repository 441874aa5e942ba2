"""`trainer.fuse_elementwise`: the learner's RMSNorms and SwiGLU products as compiled functions.

In eager mode a transformers RMSNorm is about eight kernels forward (cast to fp32, square, mean,
add eps, rsqrt, scale, cast back, weight), each a pass over the activations, and as many again
backward; a Qwen3 layer has four of them (input, post-attention, q and k norms). At packed
micro-batches of 16k tokens those passes are a large share of a learner step that its model FLOPs
do not count. Here each norm and each `silu(gate) * up` runs through one `torch.compile`d function
(dynamic shapes: one compilation serves every micro-batch length), which inductor fuses into a
kernel or two each way. The maths is the modules' own, op for op, so only the order of the fp32
sum may differ. Modules are patched in place by convention (an `...RMSNorm` with `weight` and
`variance_epsilon`; an MLP with `gate_proj`, `up_proj`, `down_proj` and an `act_fn` that computes
SiLU), and the
patch reports how many it changed so a model it does not recognise is refused rather than silently
left as it was.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    """Compiled on first use, not at import (torch.compile pulls in dynamo)."""
    return torch.compile(fn, dynamic=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm forward, compiled: normalise in fp32, cast back, scale by the weight."""
    return _compiled(_rms_norm)(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, compiled."""
    return _compiled(_silu_mul)(gate, up)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight") and hasattr(
        module, "variance_epsilon")


def _is_silu(act) -> bool:
    """nn.SiLU, or an activation module that computes SiLU (transformers has its own class for it)."""
    if isinstance(act, nn.SiLU):
        return True
    if not isinstance(act, nn.Module) or any(True for _ in act.parameters()):
        return False
    probe = torch.linspace(-6.0, 6.0, 25)
    with torch.no_grad():
        return torch.equal(act(probe), F.silu(probe))


def _is_swiglu(module: nn.Module) -> bool:
    return all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and _is_silu(
        getattr(module, "act_fn", None))


def fuses_by_default(device: torch.device) -> bool:
    """`trainer.fuse_elementwise: null`: on CUDA (1.21x per 1.7B learner step on an H200), never on the
    CPU, where compiling costs more than it saves."""
    return device.type == "cuda"


def can_fuse(model: nn.Module) -> bool:
    """Whether `model` has a norm `fuse_elementwise` recognises (the default on CUDA fuses only then)."""
    return any(_is_norm(m) for m in model.modules())


def fuse_elementwise(model: nn.Module) -> dict[str, int]:
    """Route every RMSNorm and SwiGLU MLP of `model` through the compiled functions (in place, before
    FSDP2 wraps it); returns how many of each were patched. Raises ValueError if it finds no norm."""
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        if _is_norm(module):
            module.forward = types.MethodType(_norm_forward, module)
            counts["rms_norm"] += 1
        elif _is_swiglu(module):
            module.forward = types.MethodType(_mlp_forward, module)
            counts["swiglu"] += 1
    if counts["rms_norm"] == 0:
        raise ValueError(f"trainer.fuse_elementwise: {type(model).__name__} has no RMSNorm this knows how to fuse "
                         "(an ...RMSNorm module with weight and variance_epsilon); set it to false")
    return counts
