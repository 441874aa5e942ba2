"""One engine step on the device: sequences -> metadata -> model -> last-token logits."""

from __future__ import annotations

import torch

from kv4rl.engine.attention import AttnMetadata, reference_paged_attention
from kv4rl.engine.kv_formats import KVFormat
from kv4rl.engine.sequence import Sequence


class ModelRunner:
    """Owns the model and the per-layer paged KV caches."""

    def __init__(self, model, num_layers: int, num_kv_heads: int, head_dim: int, kv_format: KVFormat,
                 num_blocks: int, block_size: int, device: torch.device, max_num_seqs: int = 1):
        self.model = model
        self.kv_format = kv_format
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        self.caches = [
            kv_format.allocate(num_slots, num_kv_heads, head_dim, device, num_seq_slots=max_num_seqs)
            for _ in range(num_layers)
        ]

    @property
    def cache_bytes(self) -> int:
        """Bytes held by every layer's cache tensors (pages, scales, per-sequence rows)."""
        return sum(t.numel() * t.element_size() for cache in self.caches for t in cache.values())

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute KV for every sequence's uncached tokens; return logits[B, V] of each last token."""
        assert all(s.seq_slot >= 0 for s in seqs), "only running (scheduled) sequences can be forwarded"
        query_lens = [s.num_new_tokens for s in seqs]
        input_ids = [t for s in seqs for t in s.token_ids[s.num_cached_tokens:]]
        meta = AttnMetadata.build(
            query_lens=query_lens,
            context_lens=[len(s) for s in seqs],
            block_tables=[s.block_table for s in seqs],
            block_size=self.block_size,
            seq_ids=[s.seq_id for s in seqs],
            device=self.device,
            seq_slots=[s.seq_slot for s in seqs],
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)

        def attention(layer: int, q, k, v):
            return reference_paged_attention(q, k, v, self.caches[layer], self.kv_format, meta)

        hidden = self.model(ids, meta.positions, attention)
        last = torch.cumsum(torch.tensor(query_lens, device=self.device), 0) - 1
        for s in seqs:
            s.num_cached_tokens = len(s)
        return self.model.compute_logits(hidden[last])
