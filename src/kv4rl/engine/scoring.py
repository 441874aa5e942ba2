"""Teacher-forced scoring through the engine's torch reference path, in any weight and KV format.

`Engine.score_tokens` replays forced tokens through the engine's own cache and kernels, one decode
step at a time, in the engine's fixed formats. Mismatch attribution (`kv4rl.telemetry.attribution`)
instead needs the same response scored several ways: weights of a given version, BF16 or FP8
linears, a BF16 or quantized KV cache, always through the reference attention. `ScoringModel` is a
decoder of the engine's shape that takes any HF-named weights; `reference_logprobs` runs one prefill
of prompt + response through a fresh paged cache of the given format and reads every response
token's log-prob. A reference prefill computes what token-by-token decoding would (queries read the
quantized cache, KV4 protects each query's own recent window; see `kv4rl.engine.attention`), so the
result is the reference engine's behaviour log-prob for that response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv4rl.engine.attention import AttnMetadata, reference_paged_attention
from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.kv_formats import KVFormat
from kv4rl.engine.sampler import truncate_logits
from kv4rl.models.args import ModelArgs
from kv4rl.models.decoder import Decoder

ROWS_PER_CHUNK = 256  # logits rows per log-softmax chunk: bounds the fp32 [rows, V] work space


def scoring_model(args: ModelArgs, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> Decoder:
    """An uninitialised decoder of `args` (fill it with `load_hf_state_dict`); `fp8` swaps its block
    linears for the engine's FP8 ones, which quantize whatever weights are loaded, as a refresh does."""
    with torch.device("meta"):
        model = Decoder(args, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.build_cache(device)
    model.requires_grad_(False)
    if fp8:
        from kv4rl.engine.fp8_weights import apply_fp8_weights

        apply_fp8_weights(model)
    return model.eval()


@dataclass(frozen=True, slots=True)
class Sampling:
    """The distribution the engine sampled from: temperature, then top-k / top-p / min-p truncation."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@torch.inference_mode()
def reference_logprobs(model: Decoder, kv_format: KVFormat, prompt: list[int], response: list[int],
                       sampling: Sampling, block_size: int = 16,
                       calibration: list[dict[str, torch.Tensor]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 log-probs [T] of the T response tokens given the prompt and the tokens before them,
    under softmax(logits / temperature), and (when `sampling` truncates) under the truncated
    distribution the sampler reports; the second is None otherwise. `calibration`: what the engine's
    cache calibrated once per layer (`Engine.kv_calibration`, NVFP4's scales), so this cache quantizes
    as the engine's did instead of calibrating on this one response."""
    if not prompt or not response:
        raise ValueError("reference_logprobs needs a non-empty prompt and response")
    args, device = model.args, next(model.parameters()).device
    num_tokens = len(prompt) + len(response)
    num_blocks = blocks_needed(num_tokens, block_size)
    caches = [kv_format.allocate(num_blocks * block_size, args.num_kv_heads, args.head_dim, device)
              for _ in range(args.num_layers)]
    for cache, kept in zip(caches, calibration or (), strict=calibration is not None):
        for key, value in kept.items():
            cache[key].copy_(value)
    meta = AttnMetadata.build(query_lens=[num_tokens], context_lens=[num_tokens],
                              block_tables=[list(range(num_blocks))], block_size=block_size, seq_ids=[0],
                              device=device)
    ids = torch.tensor(prompt + response, dtype=torch.long, device=device)

    def attention(layer: int, q, k, v):
        return reference_paged_attention(q, k, v, caches[layer], kv_format, meta)

    hidden = model(ids, meta.positions, attention)[len(prompt) - 1: num_tokens - 1]  # row t predicts response[t]
    targets = ids[len(prompt):, None]
    plain, truncated = [], []
    for start in range(0, len(response), ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        scaled = model.compute_logits(hidden[rows]) / sampling.temperature  # float32, as the sampler scales
        plain.append(scaled.log_softmax(-1).gather(1, targets[rows]).squeeze(1))
        if sampling.truncates:
            n = scaled.shape[0]
            cut = truncate_logits(scaled, torch.full((n,), sampling.top_k, device=device),
                                  torch.full((n,), sampling.top_p, device=device),
                                  torch.full((n,), sampling.min_p, device=device))
            truncated.append(cut.log_softmax(-1).gather(1, targets[rows]).squeeze(1))
    return torch.cat(plain).double().cpu(), torch.cat(truncated).double().cpu() if truncated else None

