"""The engine's GPU fast path for decode rows: fused quantize-on-write, then split-KV paged attention.

A step's rows with one new token (decodes, and prefix-sharing forks that compute a prompt's last
token) go through the Triton kernels; longer rows (prefills, re-prefills after preemption) keep the
reference path, which dequantizes the context once and runs SDPA. Both write the same cache, so a
sequence may move between them from step to step. Which path runs is decided once, when the engine
starts, and logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kv4rl.engine.sequence import Sequence

FAST_FORMATS = ("bf16", "fp8", "int4", "kv4")
DEFAULT_MAX_SPLITS = 32


def fast_path_problem(kv_format, dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why the Triton path cannot serve this engine, or None when it can."""
    from kv4rl.kernels import interpreting, triton_importable

    if device.type != "cuda" and not interpreting():
        return "no CUDA device"
    if not triton_importable():
        return "Triton is not installed"
    if kv_format.name not in FAST_FORMATS:
        return f"no decode kernel for KV format '{kv_format.name}' (kernels: {', '.join(FAST_FORMATS)})"
    if kv_format.name in ("int4", "kv4") and kv_format.group_size != head_dim:
        return (f"the INT4 kernels keep one scale per token and head: engine.kv.group_size must equal "
                f"head_dim={head_dim}, got {kv_format.group_size}")
    if dtype != torch.bfloat16:
        return f"the kernels run bf16 models, this one is {dtype}"
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 32, got {head_dim}"
    return None


@dataclass
class DecodeInputs:
    """What the decode kernels need for one step (static tensors when replayed in a CUDA graph)."""

    slots: torch.Tensor  # [B] long: cache slot of each row's new token (-1: padding)
    protect_rows: torch.Tensor | None  # [B] long: KV4 side row of the new token (-1: none)
    batch: object  # kernels.decode_attention.DecodeBatch


class FastAttention:
    """Binds the kernels to one KV format and model shape."""

    def __init__(self, kv_format, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
                 max_splits: int = DEFAULT_MAX_SPLITS, num_q_heads: int | None = None):
        from kv4rl.kernels.decode_attention import KINDS

        self.fmt = kv_format
        self.kind = "int4" if kv_format.name in ("int4", "kv4") else kv_format.name
        assert self.kind in KINDS
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        self.max_splits = max_splits
        self.side = kv_format.name == "kv4" and kv_format.budget > 0
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        self.int4_kernel = None  # 'cuda' or 'triton' for INT4 bodies (needs the query heads to decide)
        if self.kind == "int4" and num_q_heads is not None:
            from kv4rl.kernels.decode_attention import int4_backend_for

            self.int4_kernel = int4_backend_for(device, head_dim, num_q_heads // num_kv_heads, num_kv_heads,
                                                block_size)[0]

    def num_splits(self, batch_size: int) -> int:
        """The split grid for a batch of this size (fixed per CUDA-graph bucket)."""
        from kv4rl.kernels.decode_attention import choose_num_splits

        if self.int4_kernel == "cuda":
            from kv4rl.kernels import int4_decode_cuda

            return int4_decode_cuda.choose_num_splits(batch_size, self.num_kv_heads, self.max_splits, self.num_sms)
        return choose_num_splits(batch_size, self.num_kv_heads, self.max_splits, self.num_sms)

    def split_size(self, max_context: int, batch_size: int) -> int:
        """Tokens per split so that `num_splits(batch_size)` splits cover the longest context."""
        from kv4rl.kernels.decode_attention import LAUNCH

        block_n = max(v["BLOCK_N"] for v in LAUNCH.values())
        per_split = math.ceil(max(1, max_context) / self.num_splits(batch_size))
        return math.ceil(per_split / block_n) * block_n

    def host_inputs(self, seqs: list[Sequence]) -> dict[str, np.ndarray]:
        """Per-row arrays for a decode step over `seqs` (each with exactly one uncached token)."""
        bs = self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        pos = lens - 1
        width = max(1, max(math.ceil(n / bs) for n in lens))
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        pages = tables[np.arange(len(seqs)), pos // bs].astype(np.int64)
        out = {
            "ids": np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs)),
            "positions": pos,
            "slots": pages * bs + pos % bs,
            "context_lens": lens.astype(np.int32),
            "seq_slots": np.fromiter((s.seq_slot for s in seqs), dtype=np.int32, count=len(seqs)),
            "block_tables": tables,
        }
        out["protect_rows"] = self.protect_rows(pos, out["seq_slots"].astype(np.int64))
        return out

    def protect_rows(self, positions: np.ndarray, seq_slots: np.ndarray) -> np.ndarray:
        """KV4: the side row of each decode token, -1 where it is not protected (`KV4Format`'s rules)."""
        if not self.side:
            return np.full_like(positions, -1)
        pos, slots = torch.from_numpy(positions), torch.from_numpy(seq_slots)
        rows = self.fmt.side_rows(slots, pos)
        return torch.where(self.fmt.is_protected(pos, pos), rows, -1).numpy()

    def device_inputs(self, host: dict[str, np.ndarray]) -> DecodeInputs:
        from kv4rl.kernels.decode_attention import DecodeBatch

        to = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)
        split = self.split_size(int(host["context_lens"].max()), len(host["slots"]))
        batch = DecodeBatch(block_tables=to(host["block_tables"]), context_lens=to(host["context_lens"]),
                            seq_slots=to(host["seq_slots"]),
                            split_size=torch.tensor([split], dtype=torch.int32, device=self.device),
                            max_splits=self.num_splits(len(host["slots"])), block_size=self.block_size)
        return DecodeInputs(slots=to(host["slots"]), protect_rows=to(host["protect_rows"]) if self.side else None,
                            batch=batch)

    # ---- per layer --------------------------------------------------------------------------------
    def write(self, cache: dict, k: torch.Tensor, v: torch.Tensor, inputs: DecodeInputs) -> None:
        from kv4rl.kernels.kv_write import write_kv

        rotate = self.fmt.rotate
        for prefix, x in (("k", k), ("v", v)):
            rot = rotate == "kv" or (prefix == "k" and rotate == "k")
            if self.kind == "bf16":
                write_kv(x, inputs.slots, store="bf16", out=cache[prefix], rotate=rot)
                continue
            kw = {}
            if self.side:
                kw = {"protect_rows": inputs.protect_rows, "prot_codes": cache[f"{prefix}_prot_codes"],
                      "prot_scale": cache[f"{prefix}_prot_scale"]}
            write_kv(x, inputs.slots, store=self.kind, out=cache[f"{prefix}_codes"],
                     scale=cache[f"{prefix}_scale"], zero=cache.get(f"{prefix}_zero"),
                     group_size=self.head_dim, rotate=rot, **kw)

    def attend(self, cache: dict, q: torch.Tensor, inputs: DecodeInputs, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """q[B, Hq, D] over each row's cached context; `out` (e.g. float32) receives the result."""
        from kv4rl.kernels.decode_attention import paged_decode_attention

        if self.kind == "bf16":
            q = self.fmt.prepare_query(q)
            out = paged_decode_attention(q, cache["k"], cache["v"], inputs.batch, kind="bf16", out=out)
        else:
            side = None
            if self.side:
                side = {"k": cache["k_prot_codes"], "v": cache["v_prot_codes"], "k_scale": cache["k_prot_scale"],
                        "v_scale": cache["v_prot_scale"], "n_sink": self.fmt.n_sink, "n_recent": self.fmt.n_recent}
            out = paged_decode_attention(q, cache["k_codes"], cache["v_codes"], inputs.batch, kind=self.kind,
                                         k_scale=cache["k_scale"], v_scale=cache["v_scale"],
                                         k_zero=cache.get("k_zero"), v_zero=cache.get("v_zero"), side=side,
                                         out=out, rotate_query=self.fmt.rotate != "none")
        return self.fmt.finish_output(out)

    def decode(self, cache: dict, q, k, v, inputs: DecodeInputs) -> torch.Tensor:
        """Write the rows' new K/V, then attend each row's query over its sequence's whole context."""
        self.write(cache, k, v, inputs)
        return self.attend(cache, q, inputs)
