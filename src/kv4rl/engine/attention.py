"""Explicit attention metadata and the torch reference paged attention (the oracle; runs on CPU).

One code path serves prefill, re-prefill after preemption and decode: the new tokens' K/V are
written into the paged cache through the KV format, then every sequence's whole context is
gathered (dequantized) and attended with a mask `key_pos <= query_pos < context_len`.
Because prefill queries also read the (quantized) cache, a prefill computes exactly what
token-by-token decoding would, so recomputing a preempted sequence restores the same cache.
The per-step tensors (padding index, mask) are built once per step, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMetadata:
    """Everything attention needs for one engine step over B sequences and N new tokens.

    slot_mapping[N]: cache slot (block * block_size + offset) of each new token.
    positions[N]: position of each new token in its sequence.
    block_tables[B, max_blocks]: padded with 0 (masked by context_lens).
    context_lens[B]: tokens in the cache per sequence after this step's write.
    query_index[B, Qmax] / query_valid[B, Qmax]: where each padded query row comes from in N.
    mask[B, 1, Qmax, Lmax]: which cached keys each query may attend to.
    seq_slots[B]: running-sequence slot of each sequence (rows of per-sequence cache state).
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    mask: torch.Tensor
    block_size: int
    max_context_len: int
    seq_ids: list[int]
    seq_slots: torch.Tensor

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        seq_ids: list[int],
        device: torch.device,
        seq_slots: list[int] | None = None,
    ) -> AttnMetadata:
        """`seq_slots: None` gives each sequence its batch index (fine for a single step)."""
        positions, slots = [], []
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables):
            for p in range(ctx - qlen, ctx):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        num_seqs, q_max = len(query_lens), max(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        qlens = torch.tensor(query_lens)
        starts = torch.cumsum(qlens, 0) - qlens
        offs = torch.arange(q_max)
        query_valid = offs[None, :] < qlens[:, None]
        query_index = torch.where(query_valid, starts[:, None] + offs[None, :], 0)
        ctx = torch.tensor(context_lens)
        l_max = max(context_lens)
        q_pos = ctx[:, None] - qlens[:, None] + offs[None, :]  # [B, Qmax]
        k_pos = torch.arange(l_max)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])
        to = {"device": device}
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, **to),
            positions=torch.tensor(positions, dtype=torch.long, **to),
            block_tables=tables.to(**to),
            context_lens=ctx.to(**to),
            query_index=query_index.to(**to),
            query_valid=query_valid.to(**to),
            mask=mask[:, None].to(**to),
            block_size=block_size,
            max_context_len=l_max,
            seq_ids=seq_ids,
            seq_slots=torch.tensor(list(range(num_seqs)) if seq_slots is None else seq_slots,
                                   dtype=torch.long, **to),
        )

    def context_slots(self) -> torch.Tensor:
        """[B, Lmax] cache slot of every context position (padding points at valid memory)."""
        offs = torch.arange(self.max_context_len, device=self.block_tables.device)
        blocks = self.block_tables.gather(1, (offs // self.block_size).expand(len(self.seq_ids), -1))
        return blocks * self.block_size + offs % self.block_size

    def query_positions(self) -> torch.Tensor:
        """[B, Qmax] position of each padded query row (rows past a sequence's queries run on)."""
        q_lens = self.query_valid.sum(1)
        offs = torch.arange(self.query_valid.shape[1], device=q_lens.device)
        return self.context_lens[:, None] - q_lens[:, None] + offs[None, :]

    def token_seq_index(self) -> torch.Tensor:
        """[N] which sequence of the batch each new token belongs to."""
        seqs = torch.arange(len(self.seq_ids), device=self.query_valid.device)
        return seqs.repeat_interleave(self.query_valid.sum(1))


def reference_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: dict, kv_format, meta: AttnMetadata
) -> torch.Tensor:
    """Write k/v[N, Hkv, D] into the cache, then attend q[N, Hq, D] over each sequence's context.

    The format hands back the keys/values to attend over and the mask that goes with them (a plain
    format: the dequantized context and `meta.mask`; KV4: its INT8 and INT4 copies side by side).
    """
    keys, values, mask = kv_format.append_and_read(cache, meta, k, v, dtype=q.dtype)  # [B, L', Hkv, D]
    q = kv_format.prepare_query(q)
    q_pad = q[meta.query_index]  # [B, Qmax, Hq, D]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=q.shape[1] != keys.shape[2],
    ).transpose(1, 2)  # [B, Qmax, Hq, D]
    out = kv_format.finish_output(out)
    return out[meta.query_valid]
