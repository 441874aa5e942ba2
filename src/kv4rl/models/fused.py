"""The decoder's forward with its elementwise work in fused Triton kernels: the engine's opt-in
(`Decoder.enable_fused_ops`, `engine.fused_ops`).

Same modules, weights and attention callable as the eager `Decoder.forward`, which stays the reference;
each kernel repeats the eager operations of `kv4rl.models.layers` in the same dtypes
(`kv4rl.kernels.fused_ops` says how exactly). Per layer that leaves the seven projections, the
attention callable and four launches: the input norm, per-head q/k norm + RoPE, the post-attention
norm and SiLU(gate) * up, instead of some sixty small torch kernels (with the engine's merged
projections, `kv4rl.engine.merged_linears`, the seven projections are four GEMMs). Each residual add moves into
the norm that reads its sum (so a layer returns its MLP output and the residual stream separately):
the sums are the eager ones, computed one kernel later.

With FP8 linears that quantize their inputs in one kernel (`engine.fused_ops` with FP8 weights), the
norm before q|k|v and gate|up and the SwiGLU before down quantize their outputs themselves
(`enable_fp8_inputs`): the linears get the codes and scales (`QuantizedRows`) they would have computed,
bit for bit, and a layer makes three launches fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv4rl.kernels.fused_ops import add_rms_norm, rms_norm, rms_norm_fp8, silu_mul, silu_mul_fp8
from kv4rl.kernels.rope import qk_norm_rope
from kv4rl.quant.fp8 import QuantizedRows


@dataclass(frozen=True)
class FP8Inputs:
    """Which of a layer's FP8 linears take codes from the kernel before them (`enable_fp8_inputs`)."""

    qkv: bool
    gate_up: bool
    down: bool


def _takes_codes(linears, dtype, device) -> bool:
    """All these linears quantize their input with the Triton kernel for the tensor-core product."""
    from kv4rl.engine.fp8_linear import SCALED_MM_PATH, FP8Linear

    return all(isinstance(m, FP8Linear) and m.fused_quant and m.path(dtype, device) == SCALED_MM_PATH for m in linears)


def enable_fp8_inputs(model, enabled: bool = True) -> int:
    """Let each layer's norms and SwiGLU hand their FP8 linears codes where all of the consumers take
    them (`_takes_codes`); returns how many layers do anywhere. Off: every linear quantizes its input."""
    param = model.model.embed_tokens.weight
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.qkv_proj.linear] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj.linear] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
        flags = FP8Inputs(*(enabled and _takes_codes(group, param.dtype, param.device)
                            for group in (qkv, gate_up, [mlp.down_proj])))
        layer.fp8_inputs = flags if any((flags.qkv, flags.gate_up, flags.down)) else None
        count += layer.fp8_inputs is not None
    return count


def decoder_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
    """`Decoder.forward` (final-norm hidden states [N, C]) through the fused kernels."""
    x_NC = model.model.embed_tokens(input_ids)
    residual_NC = None
    for layer_idx, layer in enumerate(model.model.layers):
        x_NC, residual_NC = _layer(layer, x_NC, residual_NC, positions, model.rotary, attention, layer_idx)
    return _norm(model.model.norm, x_NC, residual_NC)[0]


def _norm(norm, x_NC, residual_NC, fp8_out: bool = False):
    """(norm(residual + x), residual + x); the first layer has no pending sum. `fp8_out`: the norm as the
    codes and scales of an FP8 linear's input."""
    if fp8_out:
        codes, scale, summed = rms_norm_fp8(x_NC, norm.weight, norm.eps, residual_NC)
        return QuantizedRows(codes, scale, x_NC.dtype), (x_NC if residual_NC is None else summed)
    if residual_NC is None:
        return rms_norm(x_NC, norm.weight, norm.eps), x_NC
    return add_rms_norm(x_NC, residual_NC, norm.weight, norm.eps)


def _layer(layer, x_NC, residual_NC, positions_N, rotary, attention, layer_idx):
    fp8 = getattr(layer, "fp8_inputs", None) or FP8Inputs(False, False, False)
    h_NC, residual_NC = _norm(layer.input_layernorm, x_NC, residual_NC, fp8.qkv)
    h_NC = _attention(layer.self_attn, h_NC, positions_N, rotary, attention, layer_idx)
    h_NC, residual_NC = _norm(layer.post_attention_layernorm, h_NC, residual_NC, fp8.gate_up)
    mlp = layer.mlp
    gate, up = mlp.project_gate_up(h_NC)  # strided views of a merged gate|up are read in place
    act = QuantizedRows(*silu_mul_fp8(gate, up), gate.dtype) if fp8.down else silu_mul(gate, up)
    out_NC = mlp.down_proj(act)
    return (out_NC if mlp.reduce is None else mlp.reduce(out_NC)), residual_NC


def _attention(attn, x_NC, positions_N, rotary, attention, layer_idx):
    num_tokens = positions_N.shape[0]  # x_NC may be an FP8 linear's codes (QuantizedRows)
    # Merged q|k|v: views with its row stride, no copies; the kernel reads q and k by their strides and
    # writes new contiguous tensors, v goes to the attention's KV write, which also takes any row stride.
    q_NHD, k_NHD, v_NHD = (t.view(num_tokens, -1, attn.head_dim) for t in attn.project_qkv(x_NC))
    if attn.q_norm is not None:
        weights, eps = (attn.q_norm.weight, attn.k_norm.weight), attn.q_norm.eps
        assert attn.k_norm.eps == eps, "q_norm and k_norm share one eps in the fused kernel"
    else:
        weights, eps = (None, None), 0.0
    # an engine attention over rotated keys takes q and k rotated in the RoPE kernel (decoder.AttentionFn)
    rotate = getattr(attention, "rotates_qk", False)
    q_NHD, k_NHD = qk_norm_rope(q_NHD, k_NHD, *weights, eps, rotary.cos, rotary.sin, positions_N, rotate=rotate)
    out_NHD = attention(layer_idx, q_NHD, k_NHD, v_NHD, rotated=True) if rotate else attention(
        layer_idx, q_NHD, k_NHD, v_NHD)
    out_NC = attn.o_proj(out_NHD.reshape(num_tokens, -1))
    return out_NC if attn.reduce is None else attn.reduce(out_NC)
