"""The engine's GPU fast path: fused quantize-on-write, then paged attention straight from the cache.

A step's rows with one new token (decodes, and prefix-sharing forks that compute a prompt's last
token) go through the split-KV decode kernels; longer rows (prefills, prompt chunks, re-prefills after
preemption) through the varlen prefill kernel (`kernels.prefill_triton`), or, with the fast prefill
off, the reference path, which dequantizes the context once and runs SDPA. A mixed step runs both
kernels on their own rows: the decode kernel splits a long context over many programs, which a single
query needs, while the prefill kernel shares each key tile among a tile of queries. All paths write the
same cache, so a sequence may move between them from step to step. Which path runs is decided once,
when the engine starts (`kv4rl.engine.plan`), and logged. The format says which kernels it binds to
and hands them its tensors; the kernels' launch settings are this object's own (`DecodeKernels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kv4rl.engine.block_table_mirror import BlockTableMirror
from kv4rl.engine.host_copy import to_device
from kv4rl.engine.sequence import Sequence
from kv4rl.kernels import cuda_sm_count
from kv4rl.kernels.decode_common import DecodeBatch, DecodeKind

if TYPE_CHECKING:  # the kernels import Triton, which a CPU-only install may lack
    from kv4rl.kernels.decode_attention import DecodeKernels
    from kv4rl.kernels.prefill_plan import PrefillBatch

DEFAULT_MAX_SPLITS = 32
# The engine's split grid holds this many times the splits a batch of equal contexts needs, so a batch
# whose longest context is several times its mean can cut every sequence into pieces of about its
# mean share instead of one piece per sequence of a quarter of the longest (`balanced_split_size`).
GRID_FACTOR = 4
# What a piece costs besides its tokens (query load, pipeline fill, partial store, merge read), in
# tokens: a guess, only used to rank split sizes against each other.
PIECE_OVERHEAD_TOKENS = 64
# Another split size replaces the one of equal contexts only when the model says it is this much faster.
BALANCE_MARGIN = 0.8


def _ceil_div(a, b):
    return -(a // -b)


def balanced_split_size(context_lens: np.ndarray, base_splits: int, grid_splits: int, wave_pieces: float,
                        quantum: int) -> int:
    """Tokens per split for a decode batch of these contexts (a multiple of `quantum`).

    The default cuts the longest context into `base_splits` pieces (what a batch of equal contexts
    needs to fill the GPU). When lengths are skewed that leaves one piece per short sequence and the
    step waits for the longest pieces while most SMs idle. Each size of ceil(longest / g), g from
    `base_splits` to `grid_splits` (never coarser than the default), is ranked by a makespan model of
    the split grid: pieces are scheduled as SMs free (`wave_pieces` resident at once), so a step lasts
    about max(piece, work / wave_pieces), plus half a piece of tail when there are more pieces than a
    wave holds."""
    lens = np.maximum(np.asarray(context_lens, dtype=np.int64), 1)
    longest = int(lens.max())
    size = lambda g: _ceil_div(_ceil_div(longest, g), quantum) * quantum
    base = size(base_splits)
    if grid_splits <= base_splits or longest * len(lens) <= 1.25 * lens.sum():  # about equal: nothing to gain
        return int(base)
    sizes = size(np.arange(base_splits, grid_splits + 1))  # sizes[0] is the default
    pieces = _ceil_div(lens[None, :], sizes[:, None]).sum(axis=1)
    est = np.maximum(sizes, (lens.sum() + PIECE_OVERHEAD_TOKENS * pieces) / wave_pieces)
    est = est + np.where(pieces > wave_pieces, sizes / 2, 0)
    best = int(np.argmin(est))
    return int(sizes[best]) if est[best] < BALANCE_MARGIN * est[0] else int(base)


@dataclass
class DecodeInputs:
    """What the decode kernels need for one step (static tensors when replayed in a CUDA graph)."""

    slots: torch.Tensor  # [B] long: cache slot of each row's new token (-1: padding)
    protect_rows: torch.Tensor | None  # [B] long: KV4 side row of the new token (-1: none)
    batch: DecodeBatch


@dataclass
class PrefillInputs:
    """What the prefill kernel needs for one step's multi-token rows (the tokens packed row by row)."""

    slots: torch.Tensor  # [N] long: cache slot of each new token
    token_rows: torch.Tensor | None  # [N] long 0..N-1, each token's own row: KV4's step INT8 copies, the query
    # rotation (None for formats that need neither)
    keep_tokens: torch.Tensor | None  # KV4: packed index of the tokens protected at the step's end ...
    keep_rows: torch.Tensor | None  # ... and the side row each is stored to after the attention
    batch: PrefillBatch
    # KV4: every row ends within n_sink + n_recent tokens, so each position has a side row of its own (the
    # ring has not wrapped) and every new token is kept: the write stores the INT8 copies straight into the
    # side rows (`keep_rows`, one per token in order) and the kernel reads them there, without a step buffer
    direct: bool = False


def _copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> None:
    """dst[dst_rows] = src[src_rows] for byte rows (KV4's INT8 copies), moved as 8-byte words where the
    layouts allow: torch's indexed copy takes one element per thread, which for 32k tokens x 8 heads of
    K and V took 0.30 ms of a 3.2 ms prefill layer at 8B (H200 profile, bench/RESULTS.md)."""
    def words(t: torch.Tensor) -> bool:
        return t.shape[-1] % 8 == 0 and t.stride(-1) == 1 and t.storage_offset() % 8 == 0 and all(
            st % 8 == 0 for st in t.stride()[:-1])

    if dst.element_size() == 1 and words(dst) and words(src):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst[dst_rows] = src[src_rows]


class FastAttention:
    """Binds the kernels to one KV format and model shape. `kernels`: launch settings (default: a fresh
    `DecodeKernels` with the tuned ones)."""

    def __init__(self, kv_format, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
                 max_splits: int = DEFAULT_MAX_SPLITS, num_q_heads: int | None = None,
                 kernels: DecodeKernels | None = None):
        from kv4rl.kernels.decode_attention import DecodeKernels

        self.fmt = kv_format
        self.kind = kv_format.decode_kind
        assert self.kind is not None, f"KV format {kv_format.name} has no decode kernels"
        self.kernels = DecodeKernels() if kernels is None else kernels
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        self.max_splits = max_splits
        self.side = kv_format.has_side_rows
        self.num_sms = cuda_sm_count(device) if device.type == "cuda" else 4
        self.tables = BlockTableMirror()  # decode rows' block tables, extended by appends only
        self.body_kernel = None  # 'cuda' or 'triton' for INT4/FP8 bodies (needs the query heads to decide)
        if self.kind in (DecodeKind.INT4, DecodeKind.FP8) and num_q_heads is not None:
            self.body_kernel = self.kernels.body_kernel(self.kind, device, head_dim, num_q_heads // num_kv_heads,
                                                        num_kv_heads, block_size)[0]

    # the fused forward rotates q and k in its RoPE kernel where the cache rotates keys (`rotates_qk`); False
    # leaves the rotations to the write and the attention, as the eager forward does (tests compare the two)
    qk_rotation_in_rope = True

    @property
    def rotates_qk(self) -> bool:
        """The cache stores Hadamard-rotated keys, so the model's fused forward may hand q and k over rotated
        already (`rotated=True` below; `qk_norm_rope(rotate=True)` does it in the RoPE kernel's registers):
        then neither the KV write rotates the keys nor the attention the queries. For a prefill that saves
        a pass over the queries of its own."""
        return self.fmt.rotate != "none" and self.qk_rotation_in_rope

    def num_splits(self, batch_size: int) -> int:
        """The split grid for a batch of this size (fixed per CUDA-graph bucket)."""
        from kv4rl.kernels.decode_attention import choose_num_splits

        if self.body_kernel == "cuda":
            from kv4rl.kernels.decode_attention import CUDA_BODIES

            return CUDA_BODIES[self.kind].choose_num_splits(batch_size, self.num_kv_heads, self.max_splits,
                                                            self.num_sms)
        return choose_num_splits(batch_size, self.num_kv_heads, self.max_splits, self.num_sms)

    def split_size(self, max_context: int, batch_size: int) -> int:
        """Tokens per split so that `num_splits(batch_size)` splits cover the longest context."""
        block_n = self.kernels.max_block_n
        per_split = math.ceil(max(1, max_context) / self.num_splits(batch_size))
        return math.ceil(per_split / block_n) * block_n

    def grid_splits(self, batch_size: int) -> int:
        """The engine's split grid (fixed per CUDA-graph bucket): `GRID_FACTOR` x `num_splits`, room for
        `balanced_split_size` to cut skewed batches finer. Pieces past a sequence's end exit at once."""
        return self._grid(self.num_splits(batch_size))

    def _grid(self, base_splits: int) -> int:
        return min(self.max_splits, GRID_FACTOR * base_splits)

    def wave_pieces(self) -> float:
        """(sequence, split) pieces the body kernel keeps resident at once."""
        from kv4rl.kernels import decode_attention

        if self.body_kernel == "cuda":
            return decode_attention.CUDA_BODIES[self.kind].wave_pieces(self.num_kv_heads, self.num_sms)
        return decode_attention.wave_pieces(self.num_kv_heads, self.num_sms)

    def step_split_size(self, context_lens: np.ndarray, batch_size: int) -> int:
        """Tokens per split of a decode step of these contexts under the `grid_splits(batch_size)` grid."""
        base = self.num_splits(batch_size)
        return balanced_split_size(context_lens, base, self._grid(base), self.wave_pieces(), self.kernels.max_block_n)

    def host_inputs(self, seqs: list[Sequence]) -> dict[str, np.ndarray]:
        """Per-row arrays for a decode step over `seqs` (each with exactly one uncached token)."""
        bs = self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        pos = lens - 1
        width = max(1, int(-(-lens.max() // bs)))
        seq_slots = np.fromiter((s.seq_slot for s in seqs), dtype=np.int32, count=len(seqs))
        tables = self.tables.gather(seqs, seq_slots, width)  # O(new blocks) per step: see BlockTableMirror
        pages = tables[np.arange(len(seqs)), pos // bs].astype(np.int64)
        out = {
            "ids": np.fromiter((s.last_token_id for s in seqs), dtype=np.int64, count=len(seqs)),
            "positions": pos,
            "slots": pages * bs + pos % bs,
            "context_lens": lens.astype(np.int32),
            "seq_slots": seq_slots,
            "block_tables": tables,
        }
        out["protect_rows"] = self.protect_rows(pos, out["seq_slots"].astype(np.int64))
        return out

    def protect_rows(self, positions: np.ndarray, seq_slots: np.ndarray) -> np.ndarray:
        """KV4: the side row of each decode token, -1 where it is not protected (`KV4Format`'s rules)."""
        if not self.side:
            return np.full_like(positions, -1)
        return self.fmt.decode_side_rows(seq_slots, positions)

    def device_inputs(self, host: dict[str, np.ndarray]) -> DecodeInputs:
        to = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)
        split = self.step_split_size(host["context_lens"], len(host["slots"]))
        batch = DecodeBatch(block_tables=to(host["block_tables"]), context_lens=to(host["context_lens"]),
                            seq_slots=to(host["seq_slots"]),
                            split_size=to_device([split], torch.int32, self.device),
                            max_splits=self.grid_splits(len(host["slots"])), block_size=self.block_size)
        return DecodeInputs(slots=to(host["slots"]), protect_rows=to(host["protect_rows"]) if self.side else None,
                            batch=batch)

    # ---- per layer --------------------------------------------------------------------------------
    def write(self, cache: dict, k: torch.Tensor, v: torch.Tensor, inputs: DecodeInputs, rotated: bool = False
              ) -> None:
        """`rotated`: k is rotated already (see `rotates_qk`)."""
        self.pending_write(cache, k, v, inputs, rotated).run()

    def pending_write(self, cache: dict, k: torch.Tensor, v: torch.Tensor, inputs: DecodeInputs,
                      rotated: bool = False):
        """The step's write of k and v, for the attention to run (or, KV4, its INT8 item to do itself)."""
        from kv4rl.kernels.kv_write import PendingWrite

        side = {p: (cache[f"{p}_prot_codes"], cache[f"{p}_prot_scale"]) for p in ("k", "v")} if self.side else None
        return PendingWrite(k, v, inputs.slots, self.kind, self._dest(cache, "k", side, rotated),
                            self._dest(cache, "v", side, rotated), self.head_dim,
                            inputs.protect_rows if self.side else None)

    def _dest(self, cache: dict, prefix: str, side: dict | None, rotated: bool):
        """Where the write puts K or V: its pages, its rotation (none for keys that come `rotated`), and (KV4)
        the INT8 rows `side[prefix]`."""
        from kv4rl.kernels.kv_write import KVDest

        out, scale, zero = self.fmt.paged_tensors(cache, prefix)
        rotate = self.fmt.rotate == "kv" or (prefix == "k" and self.fmt.rotate == "k")
        codes, scales = side[prefix] if side is not None else (None, None)
        return KVDest(out, scale, zero, rotate and not (prefix == "k" and rotated), codes, scales)

    def attend(self, cache: dict, q: torch.Tensor, inputs: DecodeInputs, out: torch.Tensor | None = None,
               rotated: bool = False, pending=None) -> torch.Tensor:
        """q[B, Hq, D] (`rotated`: like the keys already) over each row's cached context; `out` (e.g.
        float32) receives the result. `pending`: the step's `pending_write`, run before the attention or by it."""
        from kv4rl.kernels.decode_attention import paged_decode_attention

        k, k_scale, k_zero = self.fmt.paged_tensors(cache, "k")
        v, v_scale, v_zero = self.fmt.paged_tensors(cache, "v")
        out = paged_decode_attention(q, k, v, inputs.batch, kind=self.kind, k_scale=k_scale, v_scale=v_scale,
                                     k_zero=k_zero, v_zero=v_zero, side=self.fmt.side_tensors(cache), out=out,
                                     rotate_query=self.fmt.rotate != "none" and not rotated,
                                     query_rotated=rotated, kernels=self.kernels, pending=pending)
        return self.fmt.finish_output(out)

    def decode(self, cache: dict, q, k, v, inputs: DecodeInputs, rotated: bool = False) -> torch.Tensor:
        """Write the rows' new K/V, then attend each row's query over its sequence's whole context
        (`rotated`: q and k come rotated, see `rotates_qk`)."""
        return self.attend(cache, q, inputs, rotated=rotated, pending=self.pending_write(cache, k, v, inputs, rotated))

    # ---- multi-token rows (prefill kernel) --------------------------------------------------------
    def prefill_host(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                     seq_slots: list[int], num_q_heads: int) -> dict[str, np.ndarray]:
        """Per-step arrays for rows computing `query_lens` new tokens that end at `context_lens`."""
        from kv4rl.kernels.prefill_plan import prefill_tiles, queries_per_tile

        bs, n_rows = self.block_size, len(query_lens)
        qlens = np.asarray(query_lens, dtype=np.int64)
        lens = np.asarray(context_lens, dtype=np.int64)
        width = max(1, max(len(t) for t in block_tables))
        tables = np.zeros((n_rows, width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        row = np.repeat(np.arange(n_rows), qlens)
        starts = np.concatenate(([0], np.cumsum(qlens)))
        pos = (lens - qlens)[row] + np.arange(len(row)) - starts[:-1][row]
        per_tile = queries_per_tile(self._prefill_launch(lens)["BLOCK_M"], num_q_heads // self.num_kv_heads)
        tile_seq, tile_query = prefill_tiles(query_lens, per_tile)
        out = {
            "positions": pos,
            "slots": tables[row, pos // bs].astype(np.int64) * bs + pos % bs,
            "block_tables": tables,
            "context_lens": lens.astype(np.int32),
            "query_start": starts.astype(np.int32),
            "seq_slots": np.asarray(seq_slots, dtype=np.int32),
            "tile_seq": np.asarray(tile_seq, dtype=np.int32),
            "tile_query": np.asarray(tile_query, dtype=np.int32),
            "queries_per_tile": np.asarray(per_tile),
        }
        if self.side:
            p, last = torch.from_numpy(pos), torch.from_numpy(lens[row] - 1)
            keep = self.fmt.is_protected(p, last).numpy()
            rows = self.fmt.side_rows(torch.from_numpy(out["seq_slots"][row].astype(np.int64)), p).numpy()
            out["keep_tokens"] = np.nonzero(keep)[0].astype(np.int64)
            out["keep_rows"] = rows[keep].astype(np.int64)
            inside = bool(len(lens)) and bool((lens <= self.fmt.n_sink + self.fmt.n_recent).all())
            out["direct"] = np.asarray(inside and bool(keep.all()))  # keep_rows is then one row per token, in order
        return out

    def _prefill_launch(self, context_lens: np.ndarray) -> dict:
        from kv4rl.kernels.prefill_plan import prefill_launch

        return prefill_launch(self.kind, self.side, int(context_lens.max()) if len(context_lens) else 0)

    def prefill_inputs(self, host: dict[str, np.ndarray]) -> PrefillInputs:
        from kv4rl.kernels.prefill_plan import PrefillBatch

        to = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)
        batch = PrefillBatch(block_tables=to(host["block_tables"]), context_lens=to(host["context_lens"]),
                             query_start=to(host["query_start"]), seq_slots=to(host["seq_slots"]),
                             tile_seq=to(host["tile_seq"]), tile_query=to(host["tile_query"]),
                             queries_per_tile=int(host["queries_per_tile"]), block_size=self.block_size,
                             launch=self._prefill_launch(host["context_lens"]))
        n = len(host["slots"])
        side = {}
        if self.side:
            side = {"keep_tokens": to(host["keep_tokens"]), "keep_rows": to(host["keep_rows"])}
        rows = torch.arange(n, device=self.device) if self.side or self.fmt.rotate != "none" else None
        return PrefillInputs(slots=to(host["slots"]), token_rows=rows,
                             keep_tokens=side.get("keep_tokens"), keep_rows=side.get("keep_rows"), batch=batch,
                             direct=bool(host.get("direct", False)))

    def prefill(self, cache: dict, q, k, v, inputs: PrefillInputs, rotated: bool = False) -> torch.Tensor:
        """Write the rows' new K/V (KV4: their INT8 copies to a step buffer, or straight to the side rows when
        `inputs.direct`), attend each query causally over its sequence's cache, then (KV4, from the buffer)
        store the copies protected at the step's end in the side rows. `rotated`: q and k come rotated (see
        `rotates_qk`)."""
        from kv4rl.kernels.kv_write import write_kv_pair
        from kv4rl.kernels.prefill_triton import paged_prefill_attention

        num_tokens = k.shape[0]
        fresh = int8_rows = protect_rows = None
        if self.side and inputs.direct:
            int8_rows = {p: (cache[f"{p}_prot_codes"], cache[f"{p}_prot_scale"]) for p in ("k", "v")}
            protect_rows = inputs.keep_rows
        elif self.side:
            fresh = {p: (torch.empty(num_tokens, self.num_kv_heads, self.head_dim, dtype=torch.int8, device=k.device),
                         torch.empty(num_tokens, self.num_kv_heads, dtype=torch.float32, device=k.device))
                     for p in ("k", "v")}
            int8_rows, protect_rows = fresh, inputs.token_rows
        write_kv_pair(k, v, inputs.slots, store=self.kind, k_dest=self._dest(cache, "k", int8_rows, rotated),
                      v_dest=self._dest(cache, "v", int8_rows, rotated), group_size=self.head_dim,
                      protect_rows=protect_rows)
        kc, k_scale, k_zero = self.fmt.paged_tensors(cache, "k")
        vc, v_scale, v_zero = self.fmt.paged_tensors(cache, "v")
        q = q if rotated else self._rotated(q, inputs)
        out = paged_prefill_attention(q, kc, vc, inputs.batch, kind=self.kind, k_scale=k_scale, v_scale=v_scale,
                                      k_zero=k_zero, v_zero=v_zero, side=self.fmt.side_tensors(cache), fresh=fresh,
                                      fresh_in_side=inputs.direct)
        if fresh is not None:
            for prefix in ("k", "v"):
                codes, scale = fresh[prefix]
                _copy_rows(cache[f"{prefix}_prot_codes"], inputs.keep_rows, codes, inputs.keep_tokens)
                cache[f"{prefix}_prot_scale"][inputs.keep_rows] = scale[inputs.keep_tokens]
        return self._rotated(out, inputs) if self.fmt.rotate == "kv" else out

    def _rotated(self, x: torch.Tensor, inputs: PrefillInputs) -> torch.Tensor:
        """The step's packed queries (or, with rotated values, outputs) rotated like the keys, by the write's
        rotation (`prepare_query` / `finish_output` do it in float32 for the reference path)."""
        from kv4rl.kernels.kv_write import rotate_rows

        return rotate_rows(x, inputs.token_rows) if self.fmt.rotate != "none" else x
