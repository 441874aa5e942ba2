"""CUDA graphs for small prefills: one graph per token-count bucket, captured on first use.

Partial rollout admits a GRPO group every few dozen steps; its prompt (one row, its siblings fork the
cache) runs after the step's decode graph. Eagerly that is some thirty launches a layer from Python:
18-54 ms of host time per admission on an H200 (bench/RESULTS.md, sixteenth session) for a prefill whose
matmuls alone take about a millisecond at 1.7B (2 x 1.7 G parameters x 256 tokens at 778 TFLOP/s), more than a tenth of a partial batch. A graph replays it at the
GPU's pace.

Inputs live in static buffers sized for the largest bucket. A step's tokens are padded to a bucket
with tokens that write nothing (slot -1); rows up to `MAX_ROWS` are padded with rows of no queries and
no context, and query tiles with tiles of such a row (they load nothing and store nothing). KV4's side
rows protected at the step's end are padded by repeating the first one (the same value written twice).
Without CUDA (tests) the same padded forward runs eagerly, so the padding is checked on CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kv4rl.engine.cuda_graphs import capture_graph
from kv4rl.engine.fast_path import FastAttention, PrefillInputs
from kv4rl.engine.sequence import Sequence

log = logging.getLogger(__name__)

MAX_ROWS = 8  # rows of one graph prefill; a step prefilling more rows runs eagerly
SMALLEST_BUCKET = 64


def prefill_buckets(max_tokens: int) -> list[int]:
    """64, 128, 256, ... below `max_tokens`, then `max_tokens` itself."""
    sizes, b = [], SMALLEST_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PrefillGraphs:
    """`max_tokens`: the largest bucket (`engine.prefill_graph_tokens`); `max_blocks`: block-table width
    for the longest sequence; `replay`: capture and replay graphs (CUDA), else run the padded forward."""

    def __init__(self, model, caches: list[dict], fast: FastAttention, max_tokens: int, max_blocks: int,
                 num_q_heads: int, replay: bool = True):
        from kv4rl.kernels.prefill_plan import DEFAULT_PREFILL_LAUNCH, queries_per_tile

        self.model, self.caches, self.fast = model, caches, fast
        self.buckets = prefill_buckets(max_tokens)
        self.num_q_heads = num_q_heads
        launch = DEFAULT_PREFILL_LAUNCH[(fast.kind, fast.side)]  # what the kernel takes when a batch names none
        self.per_tile = queries_per_tile(launch["BLOCK_M"], num_q_heads // fast.num_kv_heads)
        self.replay = replay
        dev = fast.device
        long = {"dtype": torch.long, "device": dev}
        i32 = {"dtype": torch.int32, "device": dev}
        rows = MAX_ROWS + 1  # the last row is the padding tiles' row: it never has queries or context
        self.ids = torch.zeros(max_tokens, **long)
        self.positions = torch.zeros(max_tokens, **long)
        self.slots = torch.full((max_tokens,), -1, **long)
        self.block_tables = torch.zeros(rows, max_blocks, **i32)
        self.context_lens = torch.zeros(rows, **i32)
        self.query_start = torch.zeros(rows + 1, **i32)
        self.seq_slots = torch.zeros(rows, **i32)
        self.tile_seq = torch.full((self.num_tiles(max_tokens),), MAX_ROWS, **i32)
        self.tile_query = torch.zeros(self.num_tiles(max_tokens), **i32)
        self.ends = torch.zeros(MAX_ROWS, **long)
        self.token_rows = torch.arange(max_tokens, **long)
        self.keep_tokens = torch.zeros(max_tokens, **long) if fast.side else None
        self.keep_rows = torch.zeros(max_tokens, **long) if fast.side else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # one output for every bucket, apart from the decode graphs' (a mixed step uses both)
        self.out = torch.empty(MAX_ROWS, model.args.vocab_size, dtype=torch.float32, device=dev)
        self.pool = None  # its own pool: the decode graph's logits are still in use when a prefill replays
        self.num_runs = 0

    def num_tiles(self, tokens: int) -> int:
        """Query tiles of a bucket: every row's last tile may be partial."""
        return -(-tokens // self.per_tile) + MAX_ROWS

    def bucket(self, rest: list[Sequence]) -> int | None:
        """The bucket that holds these prefill rows, or None (too many rows or tokens: run eagerly)."""
        if not rest or len(rest) > MAX_ROWS:
            return None
        tokens = sum(s.num_step_tokens for s in rest)
        return next((b for b in self.buckets if b >= tokens), None)

    def _inputs(self, tokens: int) -> PrefillInputs:
        from kv4rl.kernels.prefill_plan import PrefillBatch

        n_tiles = self.num_tiles(tokens)
        batch = PrefillBatch(block_tables=self.block_tables, context_lens=self.context_lens,
                             query_start=self.query_start, seq_slots=self.seq_slots,
                             tile_seq=self.tile_seq[:n_tiles], tile_query=self.tile_query[:n_tiles],
                             queries_per_tile=self.per_tile, block_size=self.fast.block_size)
        side = self.fast.side
        return PrefillInputs(slots=self.slots[:tokens], token_rows=self.token_rows[:tokens],
                             keep_tokens=self.keep_tokens[:tokens] if side else None,
                             keep_rows=self.keep_rows[:tokens] if side else None, batch=batch)

    def _run_model(self, tokens: int) -> torch.Tensor:
        inputs = self._inputs(tokens)

        def attention(layer: int, q, k, v, rotated: bool = False):
            return self.fast.prefill(self.caches[layer], q, k, v, inputs, rotated)

        attention.rotates_qk = self.fast.rotates_qk

        hidden = self.model(self.ids[:tokens], self.positions[:tokens], attention)
        return self.model.compute_logits_into(hidden[self.ends], self.out)

    def _capture(self, tokens: int) -> torch.Tensor:
        """Run this step eagerly on a side stream (it compiles the kernels and warms the allocator; its
        logits are the step's), then record the bucket's graph: capture launches nothing, so the cache
        is written once."""
        graph, self.logits[tokens], logits = capture_graph(lambda: self._run_model(tokens), self.fast.device,
                                                           self.pool, keep_warm=True)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[tokens] = graph
        log.info("captured a CUDA graph for prefills of up to %d tokens", tokens)
        return logits

    def _fill(self, rest: list[Sequence], tokens: int) -> bool:
        """Copy the rows' step inputs into the static buffers, padding to `tokens`; False (nothing
        copied) when KV4 protects none of the step's tokens, so there is no side row to pad with."""
        query_lens = [s.num_step_tokens for s in rest]
        context_lens = [s.num_cached_tokens + n for s, n in zip(rest, query_lens)]
        host = self.fast.prefill_host(query_lens, context_lens, [s.block_table for s in rest],
                                      [s.seq_slot for s in rest], self.num_q_heads)
        if self.fast.side and len(host["keep_tokens"]) == 0:
            return False
        n, rows = int(sum(query_lens)), len(rest)
        ids = [t for s, q in zip(rest, query_lens) for t in s.token_slice(s.num_cached_tokens, s.num_cached_tokens + q)]
        pad = lambda a, size, value, dtype: np.concatenate((a.astype(dtype), np.full(size - len(a), value, dtype)))
        to = torch.from_numpy
        put = lambda dst, a: dst.copy_(to(np.ascontiguousarray(a)), non_blocking=True)
        put(self.ids[:tokens], pad(np.asarray(ids, dtype=np.int64), tokens, 0, np.int64))
        put(self.positions[:tokens], pad(host["positions"], tokens, 0, np.int64))
        put(self.slots[:tokens], pad(host["slots"], tokens, -1, np.int64))
        width = host["block_tables"].shape[1]
        put(self.block_tables[:rows, :width], host["block_tables"])
        put(self.context_lens, pad(host["context_lens"], MAX_ROWS + 1, 0, np.int32))
        put(self.query_start, pad(host["query_start"], MAX_ROWS + 2, n, np.int32))
        put(self.seq_slots, pad(host["seq_slots"], MAX_ROWS + 1, 0, np.int32))
        n_tiles = self.num_tiles(tokens)
        put(self.tile_seq[:n_tiles], pad(host["tile_seq"], n_tiles, MAX_ROWS, np.int32))
        put(self.tile_query[:n_tiles], pad(host["tile_query"], n_tiles, 0, np.int32))
        ends = np.cumsum(query_lens) - 1
        put(self.ends, pad(ends, MAX_ROWS, 0, np.int64))
        if self.fast.side:
            keep_tokens, keep_rows = host["keep_tokens"], host["keep_rows"]
            put(self.keep_tokens[:tokens], pad(keep_tokens, tokens, keep_tokens[0], np.int64))
            put(self.keep_rows[:tokens], pad(keep_rows, tokens, keep_rows[0], np.int64))
        return True

    @torch.inference_mode()
    def run(self, rest: list[Sequence]) -> torch.Tensor | None:
        """Logits [R, V] of each row's last new token, the rows' new K/V written to the cache; None when
        no bucket takes the rows (run them eagerly). May be a view of the graph's output buffer: valid
        until this bucket runs again."""
        tokens = self.bucket(rest)
        if tokens is None or not self._fill(rest, tokens):
            return None
        self.num_runs += 1
        if not self.replay:
            return self._run_model(tokens)[: len(rest)]
        if tokens not in self.graphs:
            return self._capture(tokens)[: len(rest)]
        self.graphs[tokens].replay()
        return self.logits[tokens][: len(rest)]
