"""One engine step on the device: sequences -> metadata -> model -> last-token logits."""

from __future__ import annotations

import torch

from kv4rl.engine.attention import AttnMetadata, reference_paged_attention
from kv4rl.engine.fast_path import FastAttention
from kv4rl.engine.kv_formats import KVFormat
from kv4rl.engine.sequence import Sequence


class ModelRunner:
    """Owns the model and the per-layer paged KV caches."""

    def __init__(self, model, num_layers: int, num_kv_heads: int, head_dim: int, kv_format: KVFormat,
                 num_blocks: int, block_size: int, device: torch.device, max_num_seqs: int = 1,
                 fast: FastAttention | None = None, graph_max_batch: int = 0, max_model_len: int = 0):
        """`fast`: the Triton decode path (None: reference path only). `graph_max_batch` > 0 replays
        decode steps of up to that many sequences as CUDA graphs (needs `fast` on CUDA)."""
        self.model = model
        self.kv_format = kv_format
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        self.caches = [
            kv_format.allocate(num_slots, num_kv_heads, head_dim, device, num_seq_slots=max_num_seqs)
            for _ in range(num_layers)
        ]
        self.fast = fast
        self.graphs = None
        if fast is not None and graph_max_batch > 0 and device.type == "cuda":
            from kv4rl.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(model, self.caches, fast, graph_max_batch, max_blocks)

    @property
    def cache_bytes(self) -> int:
        """Bytes held by every layer's cache tensors (pages, scales, per-sequence rows)."""
        return sum(t.numel() * t.element_size() for cache in self.caches for t in cache.values())

    def apply_forks(self, seqs: list[Sequence]) -> None:
        """Make the cache copies of sequences forked this step, before any layer writes the step's KV
        (their parents decode in the same batch and overwrite the rows being copied)."""
        forks = [s.fork for s in seqs if s.fork is not None]
        if not forks:
            return
        to = {"dtype": torch.long, "device": self.device}
        src = torch.tensor([x for f in forks for x in f.src_slots], **to)
        dst = torch.tensor([x for f in forks for x in f.dst_slots], **to)
        src_seq = torch.tensor([f.src_seq_slot for f in forks], **to)
        dst_seq = torch.tensor([f.dst_seq_slot for f in forks], **to)
        for cache in self.caches:
            self.kv_format.copy_slots(cache, src, dst)
            self.kv_format.copy_seq_state(cache, src_seq, dst_seq)
        for s in seqs:
            s.fork = None

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute KV for every sequence's uncached tokens; return logits[B, V] of each last token.

        With the fast path, rows with one new token run the Triton decode kernels (as a CUDA graph
        when every row is one), the others the reference path; the model runs once over all tokens.
        The logits may be a view of a CUDA graph's output buffer: valid until the next forward.
        """
        self.apply_forks(seqs)
        assert all(s.seq_slot >= 0 for s in seqs), "only running (scheduled) sequences can be forwarded"
        if self.fast is None:
            decode, rest = [], list(seqs)
        else:
            decode = [s for s in seqs if s.num_new_tokens == 1]
            rest = [s for s in seqs if s.num_new_tokens != 1]
        host = self.fast.host_inputs(decode) if decode else None
        if not rest and self.graphs is not None and self.graphs.bucket(len(decode)) is not None:
            logits = self.graphs.run(host)
        else:
            logits = self._forward_eager(host, rest)
        for s in seqs:
            s.num_cached_tokens = len(s)
        order = decode + rest
        if all(a is b for a, b in zip(order, seqs)):
            return logits
        where = {id(s): i for i, s in enumerate(order)}
        return logits[torch.tensor([where[id(s)] for s in seqs], device=logits.device)]

    def _forward_eager(self, host, rest: list[Sequence]) -> torch.Tensor:
        """Decode rows (`host`, fast path) first, then the `rest` (reference path)."""
        num_decode = 0 if host is None else len(host["slots"])
        inputs = self.fast.device_inputs(host) if num_decode else None
        meta = None
        query_lens = [s.num_new_tokens for s in rest]
        ids = [] if host is None else host["ids"].tolist()
        positions = [] if host is None else host["positions"].tolist()
        if rest:
            meta = AttnMetadata.build(
                query_lens=query_lens,
                context_lens=[len(s) for s in rest],
                block_tables=[s.block_table for s in rest],
                block_size=self.block_size,
                seq_ids=[s.seq_id for s in rest],
                device=self.device,
                seq_slots=[s.seq_slot for s in rest],
            )
            ids += [t for s in rest for t in s.token_ids[s.num_cached_tokens:]]
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        if meta is not None:
            pos_t = torch.cat((pos_t, meta.positions))

        def attention(layer: int, q, k, v):
            cache = self.caches[layer]
            if meta is None:
                return self.fast.decode(cache, q, k, v, inputs)
            ref = reference_paged_attention(q[num_decode:], k[num_decode:], v[num_decode:], cache,
                                            self.kv_format, meta)
            if not num_decode:
                return ref
            fast = self.fast.decode(cache, q[:num_decode], k[:num_decode], v[:num_decode], inputs)
            return torch.cat((fast, ref))

        hidden = self.model(ids_t, pos_t, attention)
        last = torch.arange(num_decode, device=self.device)
        if rest:
            ends = torch.cumsum(torch.tensor(query_lens, device=self.device), 0) - 1 + num_decode
            last = torch.cat((last, ends))
        return self.model.compute_logits(hidden[last])
