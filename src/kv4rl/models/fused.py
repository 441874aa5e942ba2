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
"""

from __future__ import annotations

import torch

from kv4rl.kernels.fused_ops import add_rms_norm, qk_norm_rope, rms_norm, silu_mul


def decoder_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
    """`Decoder.forward` (final-norm hidden states [N, C]) through the fused kernels."""
    x_NC = model.model.embed_tokens(input_ids)
    residual_NC = None
    for layer_idx, layer in enumerate(model.model.layers):
        x_NC, residual_NC = _layer(layer, x_NC, residual_NC, positions, model.rotary, attention, layer_idx)
    return _norm(model.model.norm, x_NC, residual_NC)[0]


def _norm(norm, x_NC, residual_NC):
    """(norm(residual + x), residual + x); the first layer has no pending sum."""
    if residual_NC is None:
        return rms_norm(x_NC, norm.weight, norm.eps), x_NC
    return add_rms_norm(x_NC, residual_NC, norm.weight, norm.eps)


def _layer(layer, x_NC, residual_NC, positions_N, rotary, attention, layer_idx):
    h_NC, residual_NC = _norm(layer.input_layernorm, x_NC, residual_NC)
    h_NC = _attention(layer.self_attn, h_NC, positions_N, rotary, attention, layer_idx)
    h_NC, residual_NC = _norm(layer.post_attention_layernorm, h_NC, residual_NC)
    mlp = layer.mlp
    out_NC = mlp.down_proj(silu_mul(*mlp.project_gate_up(h_NC)))  # strided views of a merged gate|up are read in place
    return (out_NC if mlp.reduce is None else mlp.reduce(out_NC)), residual_NC


def _attention(attn, x_NC, positions_N, rotary, attention, layer_idx):
    num_tokens = x_NC.shape[0]
    # Merged q|k|v: views with its row stride, no copies; the kernel reads q and k by their strides and
    # writes new contiguous tensors, v goes to the attention's KV write, which also takes any row stride.
    q_NHD, k_NHD, v_NHD = (t.view(num_tokens, -1, attn.head_dim) for t in attn.project_qkv(x_NC))
    if attn.q_norm is not None:
        weights, eps = (attn.q_norm.weight, attn.k_norm.weight), attn.q_norm.eps
        assert attn.k_norm.eps == eps, "q_norm and k_norm share one eps in the fused kernel"
    else:
        weights, eps = (None, None), 0.0
    q_NHD, k_NHD = qk_norm_rope(q_NHD, k_NHD, *weights, eps, rotary.cos, rotary.sin, positions_N)
    out_NHD = attention(layer_idx, q_NHD, k_NHD, v_NHD)
    out_NC = attn.o_proj(out_NHD.reshape(num_tokens, -1))
    return out_NC if attn.reduce is None else attn.reduce(out_NC)
