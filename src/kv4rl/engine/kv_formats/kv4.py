"""KV4: the INT4 cache plus INT8 copies of each sequence's sink and most recent positions.

Every position is written to the INT4 pages (rotated keys by default). In addition, the first
`n_sink` positions and the `n_recent` most recent positions of each sequence are quantized to INT8
(one float32 scale per token and head) into a side buffer. A query at position q reads the INT8 copy
of key p when `p < n_sink` or `q - p < n_recent`, and the INT4 copy otherwise; a position that leaves
the recent window just switches to its INT4 copy, nothing is re-quantized.

Side buffer layout: each running sequence owns `n_sink + n_recent` rows, chosen by its running slot
(`AttnMetadata.seq_slots`, assigned by the scheduler on admission and released on finish/preempt).
Sink positions take the first `n_sink` rows, later positions a ring of `n_recent` rows
(row `n_sink + (p - n_sink) % n_recent`), so the window slides one row per decode step.

The protection is decided per query, also inside a prefill: a long prompt's early queries see their
own recent window in INT8. Those copies come from the step's freshly quantized tokens (the ring may
already have moved past them) and, for older positions, from the side rows read before the step
overwrites them. Hence a prefill computes what token-by-token decoding would, and re-prefilling a
preempted sequence rebuilds the same cache. Sequences carried across weight updates keep their rows.
A request forked from a parent with the same prompt (prefix sharing) starts from a copy of the
parent's rows, taken while they still hold the prompt's sink and recent window.
"""

from __future__ import annotations

import numpy as np
import torch

from kv4rl.engine.kv_formats.base import DEFAULT_BYTES_CONTEXT, register_kv_format
from kv4rl.engine.kv_formats.int4 import INT4Format
from kv4rl.quant import dequantize_int8, int8_row_bytes, quantize_int8


@register_kv_format("kv4")
class KV4Format(INT4Format):
    name = "kv4"
    options = ("group_size", "n_sink", "n_recent")
    default_rotate = "k"
    per_sequence_keys = ("k_prot_codes", "k_prot_scale", "v_prot_codes", "v_prot_scale")

    def __init__(self, *, group_size: int = 128, rotate: str = "auto", n_sink: int = 16, n_recent: int = 128):
        super().__init__(group_size=group_size, rotate=rotate)
        for key, value in (("n_sink", n_sink), ("n_recent", n_recent)):
            if value < 0:
                raise ValueError(f"engine.kv.{key} must be >= 0, got {value}")
        self.n_sink, self.n_recent = n_sink, n_recent
        self.budget = n_sink + n_recent

    @property
    def has_side_rows(self) -> bool:
        return self.budget > 0

    def side_tensors(self, cache):
        """The INT8 rows and their scales, with the protection rule the INT8 work item follows."""
        if not self.has_side_rows:
            return None
        return {"k": cache["k_prot_codes"], "v": cache["v_prot_codes"], "k_scale": cache["k_prot_scale"],
                "v_scale": cache["v_prot_scale"], "n_sink": self.n_sink, "n_recent": self.n_recent}

    def check(self, head_dim, max_model_len):
        super().check(head_dim, max_model_len)
        if max_model_len is not None and self.budget > max_model_len:
            raise ValueError(
                f"engine.kv.n_sink + engine.kv.n_recent = {self.n_sink} + {self.n_recent} = {self.budget} "
                f"protected positions exceed the context limit engine.max_model_len={max_model_len}"
            )

    def allocate(self, num_slots, num_kv_heads, head_dim, device, num_seq_slots=1):
        cache = super().allocate(num_slots, num_kv_heads, head_dim, device)
        rows = num_seq_slots * self.budget
        for prefix in ("k", "v"):
            codes = torch.zeros((rows, num_kv_heads, head_dim), dtype=torch.int8, device=device)
            cache[f"{prefix}_prot_codes"] = codes
            cache[f"{prefix}_prot_scale"] = torch.zeros(codes.shape[:2], dtype=torch.float32, device=device)
        return cache

    def bytes_per_token(self, num_kv_heads, head_dim, context_len=DEFAULT_BYTES_CONTEXT):
        """INT4 for every token plus the reserved `n_sink + n_recent` INT8 rows spread over `context_len`."""
        reserve = int8_row_bytes(head_dim) * self.budget / context_len
        return 2 * num_kv_heads * (self.part_bytes(head_dim) + reserve)

    def bytes_read(self, num_kv_heads, head_dim, context_len):
        """The INT4 rows of the unprotected positions and the INT8 rows of the protected ones (the
        decode kernels read each position in one of the two)."""
        protected = min(context_len, self.budget)
        rows = (context_len - protected) * self.part_bytes(head_dim) + protected * int8_row_bytes(head_dim)
        return 2 * num_kv_heads * rows

    def copy_seq_state(self, cache, src_seq_slots, dst_seq_slots):
        """Copy every protected row of each source sequence to the matching destination sequence."""
        offsets = torch.arange(self.budget, device=src_seq_slots.device)
        src = (src_seq_slots[:, None] * self.budget + offsets).flatten()
        dst = (dst_seq_slots[:, None] * self.budget + offsets).flatten()
        for key in self.per_sequence_keys:
            cache[key][dst] = cache[key][src]

    # ---- protection -----------------------------------------------------------------------------
    def is_protected(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Whether a query at `query_pos` reads key `key_pos` from its INT8 copy (broadcasting)."""
        return (key_pos < self.n_sink) | (query_pos - key_pos < self.n_recent)

    def side_rows(self, seq_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Side-buffer row of each (sequence slot, position); meaningful for protected positions only."""
        if self.n_recent:
            ring = self.n_sink + (positions - self.n_sink) % self.n_recent
            in_seq = torch.where(positions < self.n_sink, positions, ring)
        else:
            in_seq = positions.clamp(max=self.n_sink - 1)
        return seq_slots * self.budget + in_seq

    def decode_side_rows(self, seq_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The side row of each decode row's new token (numpy, on the host: no tensors built per step), -1
        where it is not protected. A decode token is its sequence's newest, so with a recent window it is
        always protected; `side_rows` and `is_protected` with query = key position, in numpy."""
        sink = positions < self.n_sink
        if self.n_recent:
            ring = self.n_sink + (positions - self.n_sink) % self.n_recent
            return seq_slots * self.budget + np.where(sink, positions, ring)
        return np.where(sink, seq_slots * self.budget + positions, -1)

    def protected_rows(self, meta) -> torch.Tensor:
        """[N] side row of each new token that is protected at the step's end, -1 for the others
        (what the fused GPU writer takes)."""
        tok_seq = meta.token_seq_index()
        keep = self.is_protected(meta.positions, meta.context_lens[tok_seq] - 1)
        if not self.budget:
            return torch.full_like(meta.positions, -1)
        rows = self.side_rows(meta.seq_slots[tok_seq], meta.positions)
        return torch.where(keep, rows, torch.full_like(rows, -1))

    # ---- write and read ---------------------------------------------------------------------------
    def write(self, cache, meta, k, v):
        self._append(cache, meta, *self.rotate_kv(k, v))

    def _append(self, cache, meta, k, v) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """INT4 pages for every new token, INT8 rows for those protected at the step's end.

        Returns the INT8 codes and scales of all new tokens, keyed by "k"/"v".
        """
        tok_seq = meta.token_seq_index()
        keep = self.is_protected(meta.positions, meta.context_lens[tok_seq] - 1)
        rows = self.side_rows(meta.seq_slots[tok_seq[keep]], meta.positions[keep])
        fresh = {}
        for prefix, x in (("k", k), ("v", v)):
            self.store(cache, prefix, meta.slot_mapping, x)
            codes, scale = quantize_int8(x)
            if self.budget:
                cache[f"{prefix}_prot_codes"][rows] = codes[keep]
                cache[f"{prefix}_prot_scale"][rows] = scale[keep]
            fresh[prefix] = (codes, scale)
        return fresh

    def _context_rows(self, meta) -> tuple[torch.Tensor, torch.Tensor]:
        key_pos = torch.arange(meta.max_context_len, device=meta.context_lens.device)
        return key_pos, self.side_rows(meta.seq_slots[:, None], key_pos[None, :])  # [L], [B, L]

    def gather(self, cache, meta, dtype):
        """What a decode query at each sequence's last position sees: INT8 where protected, else INT4."""
        keys, values = super().gather(cache, meta, dtype)
        if not self.budget:
            return keys, values
        key_pos, rows = self._context_rows(meta)
        protected = self.is_protected(key_pos[None, :], meta.context_lens[:, None] - 1)[..., None, None]
        out = []
        for prefix, int4_values in (("k", keys), ("v", values)):
            codes, scale = cache[f"{prefix}_prot_codes"][rows], cache[f"{prefix}_prot_scale"][rows]
            int8_values = dequantize_int8(codes, scale, dtype)
            out.append(torch.where(protected, int8_values, int4_values))
        return out[0], out[1]

    def append_and_read(self, cache, meta, k, v, dtype):
        """Keys/values are the INT8 context followed by the INT4 context, [B, 2L, Hkv, D]; the mask lets
        each query see exactly one copy of each key it may attend to."""
        if not self.budget:
            return super().append_and_read(cache, meta, k, v, dtype)
        k, v = self.rotate_kv(k, v)
        key_pos, rows = self._context_rows(meta)
        # Older positions' INT8 copies are read before this step's writes may reuse their ring rows.
        older = {p: (cache[f"{p}_prot_codes"][rows], cache[f"{p}_prot_scale"][rows]) for p in ("k", "v")}
        fresh = self._append(cache, meta, k, v)
        tok_seq, slots = meta.token_seq_index(), meta.context_slots()
        both = []
        for prefix in ("k", "v"):
            codes, scale = older[prefix]
            codes[tok_seq, meta.positions], scale[tok_seq, meta.positions] = fresh[prefix]
            int8_context = dequantize_int8(codes, scale, dtype)
            both.append(torch.cat((int8_context, self.load(cache, prefix, slots, dtype)), dim=1))
        protected = self.is_protected(key_pos[None, None, :], meta.query_positions()[:, :, None])[:, None]
        mask = torch.cat((meta.mask & protected, meta.mask & ~protected), dim=-1)  # [B, 1, Qmax, 2L]
        return both[0], both[1], mask
