"""Compact Qwen3 / Qwen2 / Llama decoder for the rollout engine.

The model runs over a flattened batch of tokens from many sequences (varlen) and does not attend by
itself: each layer hands its rotated q, k and v to an ``attention`` callable that the engine injects
(paged KV cache, quantisation and kernels live there). The file stays plain PyTorch, with no cache
and no engine imports, so the engine can transform it afterwards. Its forward is the reference; the
engine may switch a model to `kv4rl.models.fused`, the same forward with fused Triton kernels for the
norms, RoPE and SwiGLU (`enable_fused_ops`).

Parameter names equal the Hugging Face checkpoint's, so loading weights (from safetensors or from
the learner's ``state_dict()`` after every update) is a copy name by name, in place.

Shape legend: N tokens, M selected rows, Hq query heads, Hkv key/value heads, D head dim,
C hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import torch
from torch import nn

from kv4rl.models.args import ModelArgs
from kv4rl.models.checkpoint_slots import LoadTarget, store
from kv4rl.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from kv4rl.models.tensor_parallel import TensorParallel, shard_args, shard_targets

# (layer_idx, q[N, Hq, D], k[N, Hkv, D], v[N, Hkv, D]) -> out[N, Hq, D]. An attention whose cache stores
# Hadamard-rotated keys may say `rotates_qk = True`: the fused forward (`kv4rl.models.fused`) then rotates
# q and k in its RoPE kernel and calls it with `rotated=True`; the eager forward never does.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


TIED_HEAD_NAME = "lm_head.weight"
EMBED_NAME = "model.embed_tokens.weight"
# Checkpoint tensors that carry no learned state (older Llama checkpoints saved RoPE frequencies).
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_size, bias=args.qkv_bias, **factory)
        self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias, **factory)
        self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias, **factory)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias, **factory)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, **factory)
        else:
            self.q_norm = self.k_norm = None
        self.head_dim = args.head_dim
        self.reduce = None  # tensor parallel: sums the ranks' partial o_proj outputs
        self.qkv_proj = None  # the engine's merged q|k|v projection (kv4rl.engine.merged_linears)

    def forward(
        self,
        x_NC: torch.Tensor,
        positions_N: torch.Tensor,
        rotary: RotaryEmbedding,
        attention: AttentionFn,
        layer_idx: int,
    ) -> torch.Tensor:
        num_tokens = x_NC.shape[0]
        q_NHD, k_NHD, v_NHD = (t.view(num_tokens, -1, self.head_dim) for t in self.project_qkv(x_NC))
        if self.q_norm is not None:
            q_NHD = self.q_norm(q_NHD)
            k_NHD = self.k_norm(k_NHD)
        q_NHD = rotary.apply_rotary(q_NHD, positions_N)
        k_NHD = rotary.apply_rotary(k_NHD, positions_N)
        out_NHD = attention(layer_idx, q_NHD, k_NHD, v_NHD)
        out_NC = self.o_proj(out_NHD.reshape(num_tokens, -1))
        return out_NC if self.reduce is None else self.reduce(out_NC)

    def project_qkv(self, x_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [N, H*D]: one merged product split (views with the row stride of q|k|v), or three."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x_NC)
        return self.q_proj(x_NC), self.k_proj(x_NC), self.v_proj(x_NC)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.self_attn = Attention(args, **factory)
        self.mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, **factory)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)

    def forward(self, x_NC, positions_N, rotary, attention, layer_idx) -> torch.Tensor:
        residual = x_NC
        x_NC = self.self_attn(self.input_layernorm(x_NC), positions_N, rotary, attention, layer_idx)
        x_NC = residual + x_NC
        residual = x_NC
        return residual + self.mlp(self.post_attention_layernorm(x_NC))


class DecoderBody(nn.Module):
    """The ``model.`` prefix of the checkpoint names."""

    def __init__(self, args: ModelArgs, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(args, **factory) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, device=None,
                 tp: TensorParallel | None = None) -> None:
        """`tp`: build this rank's shard (`kv4rl.models.tensor_parallel`); `args` stays the full model's
        in `full_args`, and `args` becomes the shard's shape (its heads, its MLP width)."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.full_args = args
        if self.tp is not None:
            args = shard_args(args, self.tp.size)
        self.args = args
        self.model = DecoderBody(args, dtype=dtype, device=device)
        if self.tp is not None:
            for layer in self.model.layers:
                layer.self_attn.reduce = layer.mlp.reduce = self.tp.all_reduce
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling, device=device
        )
        self.tie_weights()
        self._fused_forward = None

    def enable_fused_ops(self, enabled: bool = True) -> None:
        """Run `forward` through `kv4rl.models.fused` (fewer, larger kernels for a CUDA-graph decode
        step), or back through the eager reference. Imports Triton, so failures show here, not mid-step."""
        if enabled:
            from kv4rl.models.fused import decoder_forward

            self._fused_forward = decoder_forward
        else:
            self._fused_forward = None

    @property
    def fused_ops(self) -> bool:
        return self._fused_forward is not None

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (again after ``to_empty``)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Final-norm hidden states [N, C] for N flattened tokens at absolute ``positions``."""
        if self._fused_forward is not None:
            return self._fused_forward(self, input_ids, positions, attention)
        x_NC = self.model.embed_tokens(input_ids)
        for layer_idx, layer in enumerate(self.model.layers):
            x_NC = layer(x_NC, positions, self.rotary, attention, layer_idx)
        return self.model.norm(x_NC)

    def compute_logits(self, hidden_MC: torch.Tensor) -> torch.Tensor:
        """Float32 logits [M, V]; the matmul runs in the model dtype, as the learner's does."""
        return self.lm_head(hidden_MC).float()

    def compute_logits_into(self, hidden_MC: torch.Tensor, out_MV: torch.Tensor) -> torch.Tensor:
        """`compute_logits` written into the float32 buffer `out_MV` (the same values: the cast is exact),
        so CUDA graphs of several batch sizes can share one output instead of keeping one each."""
        return out_MV.copy_(self.lm_head(hidden_MC))

    # ---- weights -------------------------------------------------------------------------------

    def hf_targets(self) -> dict[str, LoadTarget]:
        """Checkpoint name -> parameter (or module slot) to fill. A tied ``lm_head.weight`` is
        omitted (it is the embedding). A module with ``checkpoint_slots()`` (an FP8 linear, say)
        names its checkpoint tensors itself, so a transformed model still loads HF names; the modules
        nested in it are its own state and name nothing."""
        targets: dict[str, LoadTarget] = dict(self.state_dict(keep_vars=True))
        owners: list[str] = []
        for prefix, module in self.named_modules():  # parents before children
            slots = getattr(module, "checkpoint_slots", None)
            if slots is None or any(prefix.startswith(owner) for owner in owners):
                continue  # a module nested in a slot owner (a merged linear's FP8Linear) is its owner's state
            owned = f"{prefix}."
            owners.append(owned)
            targets = {name: t for name, t in targets.items() if not name.startswith(owned)}
            targets.update({owned + name: t for name, t in slots().items()})
        if self.args.tie_word_embeddings:
            del targets[TIED_HEAD_NAME]
        return targets if self.tp is None else shard_targets(targets, self.tp)

    def check_hf_shapes(self, shapes: Mapping[str, Sequence[int]], strict: bool = True,
                        targets: Mapping[str, LoadTarget] | None = None) -> list[str]:
        """Validate checkpoint names and shapes; return the names that will be copied.

        Raises ValueError naming unexpected tensors, wrong shapes and (when ``strict``) missing
        parameters. A tied model accepts and skips ``lm_head.weight``. `targets`: `hf_targets()`
        when the caller already has it.
        """
        targets = self.hf_targets() if targets is None else targets
        unexpected = [name for name in shapes if name not in targets and not self.ignorable(name)]
        if unexpected:
            raise ValueError(f"unexpected tensors for {self.args.model_type}: {_preview(unexpected)}")
        wrong_shape = [
            f"{name} has shape {tuple(shape)}, expected {tuple(targets[name].shape)}"
            for name, shape in shapes.items()
            if name in targets and tuple(shape) != tuple(targets[name].shape)
        ]
        if wrong_shape:
            raise ValueError("wrong tensor shapes: " + "; ".join(wrong_shape[:5]))
        if strict:
            missing = [name for name in targets if name not in shapes]
            if missing:
                raise ValueError(f"missing parameters: {_preview(missing)}")
        return [name for name in shapes if name in targets]

    def ignorable(self, name: str) -> bool:
        """A checkpoint name that loads nothing (rotary buffers; the head of a tied-embedding model)."""
        return name.endswith(_IGNORABLE_SUFFIXES) or (
            name == TIED_HEAD_NAME and self.args.tie_word_embeddings
        )

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> int:
        """Copy ``transformers``-named tensors into the existing parameters (cast to their dtype and
        device; nothing is reallocated). Everything is validated before anything is copied.

        ``strict=False`` allows a partial update (e.g. one shard); unknown names and wrong shapes
        always raise. Returns the number of tensors copied.
        """
        targets = self.hf_targets()
        names = self.check_hf_shapes({name: tensor.shape for name, tensor in state_dict.items()}, strict, targets)
        for name in names:
            store(targets[name], state_dict[name])
        return len(names)


    @torch.no_grad()
    def load_hf_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """`load_hf_state_dict` for a stream of (name, tensor): each is checked and copied as it comes and
        may be freed at once, so a sharded learner can hand over its weights one gathered tensor at a
        time. Raises ValueError if the stream missed a parameter (those it held are already copied)."""
        targets = self.hf_targets()  # once: building it walks every module (per tensor it was O(n^2))
        seen: set[str] = set()
        for name, tensor in tensors:
            if self.ignorable(name):
                continue
            self.check_hf_shapes({name: tensor.shape}, strict=False, targets=targets)
            store(targets[name], tensor)
            seen.add(name)
        missing = [name for name in targets if name not in seen]
        if missing:
            raise ValueError(f"weight stream ended without: {_preview(missing)}")
        return len(seen)


def _preview(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit} more)"
