"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use.

A decode step launches a few hundred small kernels (per layer: norms, projections, RoPE, the fused KV
write, two attention stages); replaying them as one graph removes the launch gaps. Inputs live in
static buffers sized for the largest bucket; a step copies its rows in, pads the bucket with rows
that write nothing and attend to nothing (slot -1, context 0), replays, and reads the first B rows of
the logits. The attention grid is fixed per bucket (`FastAttention.grid_splits` splits per sequence
and head) and the tokens per split are a device value chosen per step from the contexts, so one graph
serves any context lengths. Weights are updated in place, so graphs stay valid across weight
refreshes; they hold the cache tensors, so a sleeping engine drops them with its pool and captures new
ones over the new pool when it wakes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kv4rl.engine.fast_path import DecodeInputs, FastAttention
from kv4rl.engine.staged_inputs import StagedInputs
from kv4rl.kernels.decode_attention import DecodeBatch

log = logging.getLogger(__name__)

# what a padding row of a bucket holds: no write, no attention, harmless ids
PADDING = {"ids": 0, "positions": 0, "slots": -1, "protect_rows": -1, "context_lens": 0, "seq_slots": 0}


def capture_graph(run: Callable[[], torch.Tensor], device: torch.device, pool, *, keep_warm: bool = False
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
    """Run `run` once on a side stream (it compiles the kernels and warms the allocator outside the
    capture), then record it into a graph in memory `pool` (None: a new one, `graph.pool()` after).
    Returns the graph, the captured output (the buffer each replay fills) and, with `keep_warm`, a copy
    of the warm-up run's output: the capture launches nothing, so that run is the only one that happened."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        warm = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    warm = warm.clone() if keep_warm else None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, warm


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch` (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, caches: list[dict], fast: FastAttention, max_batch: int, max_blocks: int):
        self.model, self.caches, self.fast = model, caches, fast
        self.buckets = graph_buckets(max_batch)
        self.max_batch = max_batch
        dev = fast.device
        long, i32 = torch.long, torch.int32
        self.staged = StagedInputs({
            "ids": ((max_batch,), long, 0), "positions": ((max_batch,), long, 0),
            "slots": ((max_batch,), long, -1), "protect_rows": ((max_batch,), long, -1),
            "context_lens": ((max_batch,), i32, 0), "seq_slots": ((max_batch,), i32, 0),
            "split_size": ((1,), i32, 64),
            "table_rows": ((max_batch * max_blocks,), i32, 0),  # this step's [B, width] block table, packed
        }, dev)
        for name in (*PADDING, "split_size"):  # the graph's inputs under their own names
            setattr(self, name, self.staged[name])
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=i32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # every bucket's graph writes its logits here (its first rows): a step's logits are sampled, in
        # stream order, before the next step's graph overwrites them, whatever its bucket (made at the
        # first capture)
        self.out: torch.Tensor | None = None
        self.pool = None
        self.num_replays = 0

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def _inputs(self, bs: int) -> DecodeInputs:
        batch = DecodeBatch(block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                            seq_slots=self.seq_slots[:bs], split_size=self.split_size,
                            max_splits=self.fast.grid_splits(bs), block_size=self.fast.block_size)
        return DecodeInputs(slots=self.slots[:bs], protect_rows=self.protect_rows[:bs] if self.fast.side else None,
                            batch=batch)

    def _run_model(self, bs: int) -> torch.Tensor:
        inputs = self._inputs(bs)

        def attention(layer: int, q, k, v, rotated: bool = False):
            return self.fast.decode(self.caches[layer], q, k, v, inputs, rotated)

        attention.rotates_qk = self.fast.rotates_qk

        hidden = self.model(self.ids[:bs], self.positions[:bs], attention)
        return self.model.compute_logits_into(hidden, self.out[:bs])

    @torch.inference_mode()
    def capture(self, buckets) -> None:
        """Capture these buckets now (a woken engine re-captures those it used before sleeping)."""
        for bs in buckets:
            if bs not in self.graphs:
                self._capture(bs)

    def _capture(self, bs: int) -> None:
        if self.out is None:
            self.out = torch.empty(self.max_batch, self.model.args.vocab_size, dtype=torch.float32,
                                   device=self.fast.device)
        self._clear_rows()
        torch.cuda.synchronize(self.fast.device)
        graph, self.logits[bs], _ = capture_graph(lambda: self._run_model(bs), self.fast.device, self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph
        log.info("captured a CUDA graph for decode batches of up to %d sequences", bs)

    def _clear_rows(self) -> None:
        """Every row becomes padding (`PADDING`): what a capture runs on."""
        for name, pad in PADDING.items():
            self.staged[name].fill_(pad)

    @torch.inference_mode()
    def run(self, host: dict[str, np.ndarray], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of a decode step described by `FastAttention.host_inputs`; `pending_ids`: the rows'
        input ids on the device, in place of the host's (`ModelRunner.forward`)."""
        n = len(host["slots"])
        bs = self.bucket(n)
        if bs not in self.graphs:
            self._capture(bs)
        self.load(host, bs, pending_ids)
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.logits[bs][:n]

    def load(self, host: dict[str, np.ndarray], bs: int, pending_ids: torch.Tensor | None = None) -> None:
        """Queue the step's inputs into the graph's buffers: its rows, then padding up to bucket `bs`, in
        one copy from pinned memory; the block table and `pending_ids` by a device copy each."""
        n, width = host["block_tables"].shape
        rows = self.staged.host()
        for name, pad in PADDING.items():
            if name != "ids" or pending_ids is None:
                rows[name][:n] = host[name]
            rows[name][n:bs] = pad
        rows["split_size"][0] = self.fast.step_split_size(host["context_lens"], bs)
        rows["table_rows"][:n * width] = host["block_tables"].reshape(-1)
        self.staged.upload(self.staged.end("table_rows", n * width))
        self.block_tables[:n, :width].copy_(self.staged["table_rows"][:n * width].view(n, width))
        if pending_ids is not None:
            self.ids[:n].copy_(pending_ids)
