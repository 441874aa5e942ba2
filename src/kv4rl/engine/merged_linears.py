"""One GEMM for q|k|v and one for gate|up in the engine's copy of the decoder (`engine.merge_projections`).

At decode sizes (a few hundred rows) three or two small products that read the same input waste
bandwidth and launches; vLLM and nano-vllm merge them the same way. `merge_projections` concatenates
each group's weights by output rows into one linear (plain or FP8: FP8 scales are per output channel,
so concatenating codes and scales is exact) held by a `MergedLinear`, and sets the decoder's
`qkv_proj` / `gate_up_proj` hooks, whose forwards then split the one product.

The Hugging Face names still load: each of q_proj, k_proj, ... becomes a parameterless `LinearPart`
whose `checkpoint_slots()` point at its rows of the merged weight (a view, or an FP8 slot quantizing into
those rows), so the learner's weight sync and tensor-parallel shards work unchanged, while the
`MergedLinear` hides its own state from the checkpoint names and `state_dict()` holds each weight once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from kv4rl.engine.fp8_linear import FP8Linear
from kv4rl.models.checkpoint_slots import CheckpointSlot

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class MergedLinear(nn.Module):
    """A linear over the concatenated parts (`self.linear`, nn.Linear or FP8Linear); forward returns
    the parts' outputs, views into the one product (last dim split by `sizes`). `names`: the parts'
    attribute names in the parent (q_proj, ...), for the unmerged state dict."""

    def __init__(self, linear: nn.Module, sizes: tuple[int, ...], names: tuple[str, ...]) -> None:
        super().__init__()
        if sum(sizes) != linear.out_features or len(names) != len(sizes):
            raise ValueError(f"parts {names} of {sizes} rows do not make the merged {linear.out_features} outputs")
        self.linear = linear
        self.sizes, self.names = tuple(sizes), tuple(names)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def checkpoint_slots(self) -> dict:
        """No checkpoint names of its own: the `LinearPart`s name its rows."""
        return {}

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


class LinearPart(nn.Module):
    """Rows [start, stop) of a `MergedLinear`, standing where the part's linear stood: no parameters of
    its own, its HF names map onto the merged rows."""

    def __init__(self, merged: MergedLinear, index: int) -> None:
        super().__init__()
        self.__dict__["merged"] = merged  # not a submodule: the merged linear is registered once, by its hook
        self.index = index
        self.start = sum(merged.sizes[:index])
        self.stop = self.start + merged.sizes[index]
        self.in_features, self.out_features = merged.linear.in_features, merged.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This part's output (runs the whole merged product: the decoder calls the merged module)."""
        return self.merged(x)[self.index]

    def checkpoint_slots(self) -> dict:
        """``weight`` (and ``bias``): the merged rows, written in place; FP8 rows are quantized on load."""
        inner, rows = self.merged.linear, slice(self.start, self.stop)
        if isinstance(inner, FP8Linear):
            load = functools.partial(inner.load_weight_, rows=rows)
            slots = {"weight": CheckpointSlot((self.out_features, self.in_features), load)}
        else:
            slots = {"weight": inner.weight[rows]}
        if inner.bias is not None:
            slots["bias"] = inner.bias[rows]
        return slots

    def extra_repr(self) -> str:
        return f"rows={self.start}:{self.stop} of the merged linear, in_features={self.in_features}"


@torch.no_grad()
def merge_linears(parts: Mapping[str, nn.Module]) -> MergedLinear:
    """One linear whose output rows are the parts' (name -> module; all nn.Linear or all FP8Linear,
    same input, all with or all without bias), their weights copied in."""
    names, parts = tuple(parts), list(parts.values())
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or not kinds <= {nn.Linear, FP8Linear}:
        raise TypeError(f"merge_linears takes all nn.Linear or all FP8Linear parts, got {sorted(k.__name__ for k in kinds)}")
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise ValueError(f"parts take different inputs: {[p.in_features for p in parts]} features")
    has_bias = {p.bias is not None for p in parts}
    if len(has_bias) != 1:
        raise ValueError("parts mix linears with and without bias")
    bias = has_bias.pop()
    sizes = tuple(p.out_features for p in parts)
    if isinstance(first, FP8Linear):
        linear = FP8Linear(first.in_features, sum(sizes), bias, device=first.qweight.device,
                           dtype=first.bias.dtype if bias else None)
        linear.qweight.copy_(torch.cat([p.qweight for p in parts]))
        linear.weight_scale.copy_(torch.cat([p.weight_scale for p in parts]))
        linear.use_scaled_mm, linear.fused_quant = first.use_scaled_mm, first.fused_quant
        linear.enable_decode_gemm(first.decode_gemm)
    else:
        linear = nn.Linear(first.in_features, sum(sizes), bias, device="meta")  # no random init
        linear.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if bias:
        linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return MergedLinear(linear, sizes, names)


def _merge_into(parent: nn.Module, names: tuple[str, ...]) -> MergedLinear:
    merged = merge_linears({name: getattr(parent, name) for name in names})
    for index, name in enumerate(names):
        setattr(parent, name, LinearPart(merged, index))
    return merged


def merge_projections(model: nn.Module) -> int:
    """Merge every decoder layer's q/k/v and gate/up projections in place (after any weight-format
    swap); returns the number of merged groups (layers already merged are left as they are)."""
    groups = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = _merge_into(attn, QKV)
            groups += 1
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = _merge_into(mlp, GATE_UP)
            groups += 1
    return groups


# ---- the engine's own state (checkpoints, attribution) in one layout, merged or not -------------------


def _merged_modules(model: nn.Module) -> Iterator[tuple[str, str, MergedLinear]]:
    """(prefix, parent prefix, module) of every merged linear."""
    for prefix, module in model.named_modules():
        if isinstance(module, MergedLinear):
            yield prefix, prefix.rpartition(".")[0], module


def unmerged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` under the unmerged model's names: each merged tensor (weight, bias, FP8 codes
    and scales, all by output row) split back into its parts' rows (views), so a state saved by an engine
    with merged projections loads into one without, and back (`merged_state_dict`)."""
    state = model.state_dict()
    for prefix, parent, merged in _merged_modules(model):
        for field in merged.linear.state_dict():
            rows = state.pop(f"{prefix}.linear.{field}").split(merged.sizes)
            state.update({f"{parent}.{name}.{field}": part for name, part in zip(merged.names, rows)})
    return state


def merged_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the unmerged names of `unmerged_state_dict`) under `model`'s own names: the parts' rows
    concatenated for each of its merged linears; anything else passes unchanged (for load_state_dict,
    which names what is missing)."""
    out = dict(state)
    for prefix, parent, merged in _merged_modules(model):
        for field in merged.linear.state_dict():
            names = [f"{parent}.{name}.{field}" for name in merged.names]
            if all(name in out for name in names):
                out[f"{prefix}.linear.{field}"] = torch.cat([out.pop(name) for name in names])
    return out
