"""The per-device unit of the engine: it carries out an `EnginePlan` and runs the steps.

`ModelRunner.build` does the start-up's device work: the weight format and fused ops applied to the
model, the KV pool sized (on CUDA by profiling the largest step) and allocated, decode CUDA graphs set
up. Each step then goes sequences -> metadata -> model -> last-token logits -> sampled tokens. Tensor
parallelism runs one runner per rank, each over its shard of the model and of the KV pool, behind the
same engine loop on every rank (`kv4rl.models.tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from kv4rl.engine.attention import AttnMetadata, reference_paged_attention
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.fast_path import FastAttention
from kv4rl.engine.host_copy import to_device
from kv4rl.engine.kv_formats import KVFormat
from kv4rl.engine.plan import EnginePlan
from kv4rl.engine.pool_profile import PoolProfile, memory_sized
from kv4rl.engine.sampler import sample
from kv4rl.engine.sequence import Sequence


class ModelRunner:
    """Owns the model and the per-layer paged KV caches."""

    def __init__(self, model, kv_format: KVFormat, num_blocks: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 1, fast: FastAttention | None = None, graph_max_batch: int = 0,
                 max_model_len: int = 0, sampler: str = "torch", pool_sizing: str = "", fast_prefill: bool = False,
                 prefill_graph_tokens: int = 0):
        """`fast`: the Triton decode path (None: reference path only); `fast_prefill`: rows with several new
        tokens through its prefill kernel too (else the reference path). `graph_max_batch` > 0 replays
        decode steps of up to that many sequences as CUDA graphs (needs `fast` on CUDA). `sampler`:
        "triton" draws untruncated rows with the fused kernel. `pool_sizing`: how `num_blocks` was chosen.
        `prefill_graph_tokens` > 0 (with `fast_prefill`): prefills of up to that many tokens through
        `PrefillGraphs`, replayed on CUDA with graphs and run padded but eagerly elsewhere (tests)."""
        self.model = model
        self.kv_format = kv_format
        self.block_size = block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.fast = fast
        self.fast_prefill = fast is not None and fast_prefill
        self.use_graphs = fast is not None and graph_max_batch > 0 and device.type == "cuda"
        self.graph_max_batch = graph_max_batch
        self.sampler = sampler
        self.pool_sizing = pool_sizing
        self.profile: PoolProfile | None = None  # the start-up's profiling step, kept for tests
        self.caches: list[dict] | None = None
        self.graphs = None
        self.prefill_graph_tokens = prefill_graph_tokens if self.fast_prefill else 0
        self.prefill_graphs = None
        # a step with prefill rows runs its decode rows as a graph step and its prefill rows eagerly after
        # it (None: whenever a graph covers the decode rows; True also without graphs, for CPU tests)
        self.split_mixed_steps: bool | None = None
        self.num_split_steps = 0
        self._recapture: tuple[int, ...] = ()
        self._calibration: list[dict[str, torch.Tensor]] = []  # per layer, kept by `sleep` for `wake`
        self.allocate(num_blocks)

    def allocate(self, num_blocks: int, capture: tuple[int, ...] = ()) -> None:
        """Allocate a pool of `num_blocks` blocks per layer and fresh decode graphs over it, capturing
        the `capture` buckets now (others are captured on first use)."""
        assert self.caches is None, "the pool is allocated; release it first"
        args = self.model.args
        self.num_blocks = num_blocks
        try:
            self.caches = [
                self.kv_format.allocate(num_blocks * self.block_size, args.num_kv_heads, args.head_dim, self.device,
                                        num_seq_slots=self.max_num_seqs)
                for _ in range(args.num_layers)
            ]
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not isinstance(error, torch.OutOfMemoryError) and "allocate" not in str(error):
                raise
            self.caches = None
            raise _pool_too_large(self.kv_format, args, num_blocks, self.block_size, self.max_num_seqs,
                                  self.device) from None
        if self.use_graphs:
            from kv4rl.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(self.model, self.caches, self.fast, self.graph_max_batch, max_blocks)
            self.graphs.capture(capture)
        if self.prefill_graph_tokens:
            from kv4rl.engine.prefill_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(self.model, self.caches, self.fast, self.prefill_graph_tokens,
                                                -(-self.max_model_len // self.block_size), args.num_heads,
                                                replay=self.use_graphs)

    def release(self) -> tuple[int, ...]:
        """Drop the pool and the decode graphs (their static buffers and private memory pool); returns
        the graph buckets that had been captured, so `allocate` can capture them again."""
        captured = tuple(sorted(self.graphs.graphs)) if self.graphs is not None else ()
        self.caches = None
        self.graphs = self.prefill_graphs = None
        return captured

    @property
    def allocated(self) -> bool:
        return self.caches is not None

    def sleep(self) -> None:
        """Free the pool and graphs until `wake` (the engine preempts every sequence first); what the KV
        format calibrated once (NVFP4's per-layer scales) is kept for the new pool."""
        self._calibration = self.kv_calibration()
        self._recapture = self.release()

    def wake(self) -> None:
        """Allocate the pool again: re-sized from free device memory when the start-up sized it so
        (`PoolProfile`: memory held by others now, e.g. the learner's optimizer state, counts as in use),
        else with the same blocks; the graph buckets captured before `sleep` are captured again."""
        num_blocks = self.num_blocks
        if self.profile is not None and self.profile.plan.pool_blocks.value is None:
            num_blocks, self.pool_sizing = memory_sized(self.profile, self.model, self.device)
        self.allocate(num_blocks, self._recapture)
        self.load_kv_calibration(self._calibration)
        self._calibration = []

    def kv_calibration(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, what the KV format calibrated once (`KVFormat.calibration`; NVFP4's scales), also while
        asleep: `sleep` / `wake` and checkpoints carry it, so the cache quantizes as before."""
        if self.caches is None:
            return [{key: value.clone() for key, value in kept.items()} for kept in self._calibration]
        return [self.kv_format.calibration(cache) for cache in self.caches]

    def load_kv_calibration(self, per_layer: list[dict[str, torch.Tensor]]) -> None:
        """Put back what `kv_calibration` returned (into the pool, or kept for `wake` while asleep)."""
        if self.caches is None:
            self._calibration = [{key: value.clone() for key, value in kept.items()} for kept in per_layer]
            return
        for cache, kept in zip(self.caches, per_layer, strict=True):
            for key, value in kept.items():
                cache[key].copy_(value)

    @classmethod
    def build(cls, model, plan: EnginePlan, config: EngineConfig, device: torch.device,
              reserve_bytes: int = 0) -> ModelRunner:
        """Apply `plan` to `model` on `device`: weight format, fused ops, fast path, the sized pool, graphs.
        `reserve_bytes`: device memory a pool sized from memory leaves free for later (`memory.pool_blocks`)."""
        prepare_model(model, plan)
        args, block_size = model.args, config.kv.block_size
        fast = None
        if plan.attention.value == "triton":
            fast = FastAttention(plan.kv_format, args.num_kv_heads, args.head_dim, block_size, device,
                                 num_q_heads=args.num_heads)
        profile = PoolProfile(model, plan, config, device, fast, reserve_bytes)
        num_blocks, sizing = plan.pool_blocks.value, plan.pool_blocks.reason
        if num_blocks is None:
            num_blocks, sizing = memory_sized(profile, model, device)
        runner = cls(model, plan.kv_format, num_blocks, block_size, device, max_num_seqs=plan.max_num_seqs,
                     fast=fast, graph_max_batch=plan.max_num_seqs if plan.cuda_graphs.value else 0,
                     max_model_len=plan.max_model_len.value, sampler=plan.sampler.value, pool_sizing=sizing,
                     fast_prefill=plan.prefill.value == "triton", prefill_graph_tokens=plan.prefill_graphs.value)
        runner.profile = profile
        return runner

    @property
    def cache_bytes(self) -> int:
        """Bytes held by every layer's cache tensors (pages, scales, per-sequence rows); 0 when released."""
        return sum(t.numel() * t.element_size() for cache in self.caches or () for t in cache.values())

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy learner weights (HF names) in place, from a state dict or a stream of (name, tensor);
        FP8 linears re-quantize as they copy."""
        if isinstance(weights, Mapping):
            self.model.load_hf_state_dict(weights)
        else:
            self.model.load_hf_tensors(weights)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob under the row's sampling parameters."""
        params = [s.params for s in seqs]
        # two host-to-device copies instead of six, and whether any row truncates known here: read from
        # the device tensors it would make the host wait for the forward before launching the sampler
        floats = to_device([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                           torch.float32, self.device)
        ints = to_device([[p.top_k for p in params], [s.sample_seed for s in seqs], [len(s.output_ids) for s in seqs]],
                         torch.long, self.device)
        truncated = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        greedy = [p.temperature <= 0 for p in params]
        unit = all(g or p.temperature == 1 for g, p in zip(greedy, params))
        return sample(logits, floats[0], ints[0], floats[1], ints[1], ints[2], fused=self.sampler == "triton",
                      truncated=truncated, greedy_rows=any(greedy), unit_temperature=unit,
                      min_p=floats[2] if any(p.min_p > 0 for p in params) else None)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def apply_forks(self, seqs: list[Sequence]) -> None:
        """Make the cache copies of sequences forked this step, before any layer writes the step's KV
        (their parents decode in the same batch and overwrite the rows being copied)."""
        forks = [s.fork for s in seqs if s.fork is not None]
        if not forks:
            return
        src = to_device([x for f in forks for x in f.src_slots], torch.long, self.device)
        dst = to_device([x for f in forks for x in f.dst_slots], torch.long, self.device)
        src_seq = to_device([f.src_seq_slot for f in forks], torch.long, self.device)
        dst_seq = to_device([f.dst_seq_slot for f in forks], torch.long, self.device)
        for cache in self.caches:
            self.kv_format.copy_slots(cache, src, dst)
            self.kv_format.copy_seq_state(cache, src_seq, dst_seq)
        for s in seqs:
            s.fork = None

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Compute KV for each sequence's step tokens (its uncached tokens, or the scheduler's chunk of
        them); return logits[B, V] of each row's last computed token.

        With the fast path, rows with one new token run the Triton decode kernels, the others the
        prefill kernel (or the reference path). The decode rows replay a CUDA graph when one covers
        them, also in a step that prefills (partial rollout admits prompts every few steps): the
        prefill rows then run eagerly in a second forward, instead of one eager forward over all rows,
        whose per-layer launches cost a KV4 step 52 ms against 12 ms for the graph at 256 rows
        (bench/RESULTS.md). Without graphs the model runs once over all tokens.
        The logits may be a view of a CUDA graph's output buffer: valid until the next forward.
        `pending_ids` (`engine.async_scheduling`): a device tensor of every row's input id, the tokens the
        previous step sampled and the host has not read (the rows hold `PENDING_TOKEN` in their place);
        then every row is a decode row.
        """
        self.apply_forks(seqs)
        decode, rest, computed = [], [], []  # one pass over the batch (per-step host work)
        for s in seqs:
            assert s.seq_slot >= 0, "only running (scheduled) sequences can be forwarded"
            _, new, step = s.step_counts()
            computed.append(step)
            (decode if new == 1 and self.fast is not None else rest).append(s)
        assert pending_ids is None or (not rest or self.fast is None) and len(pending_ids) == len(seqs)
        host = self.fast.host_inputs(decode) if decode else None
        graph = bool(decode) and self.graphs is not None and self.graphs.bucket(len(decode)) is not None
        split = bool(decode) and (graph if self.split_mixed_steps is None else self.split_mixed_steps)
        if rest and not decode and pending_ids is None:
            logits = self._forward_prefill(rest)
        elif rest and not split:
            logits = self._forward_eager(host, rest, pending_ids)
        else:
            logits = self.graphs.run(host, pending_ids) if graph else self._forward_eager(host, [], pending_ids)
            if rest:  # the prefill rows after the decode rows; the cat copies the graph's reused buffer
                logits = torch.cat((logits, self._forward_prefill(rest)))
                self.num_split_steps += 1
        for s, n in zip(seqs, computed):
            s.num_cached_tokens += n
        order = decode + rest
        if all(a is b for a, b in zip(order, seqs)):
            return logits
        where = {id(s): i for i, s in enumerate(order)}
        return logits[to_device([where[id(s)] for s in seqs], torch.long, logits.device)]

    def _forward_prefill(self, rest: list[Sequence]) -> torch.Tensor:
        """Logits of prefill rows alone: a prefill graph's bucket when one takes them, else eagerly."""
        logits = self.prefill_graphs.run(rest) if self.prefill_graphs is not None else None
        return self._forward_eager(None, rest) if logits is None else logits

    def _forward_eager(self, host, rest: list[Sequence], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows (`host`, fast path) first, then the `rest` (prefill kernel or reference path);
        `pending_ids`: the first rows' input ids, on the device (see `forward`)."""
        num_decode = 0 if host is None else len(host["slots"])
        inputs = self.fast.device_inputs(host) if num_decode else None
        meta = prefill = None
        query_lens = [s.num_step_tokens for s in rest]
        ids = [] if host is None else host["ids"].tolist()
        positions = [] if host is None else host["positions"].tolist()
        if rest:
            context_lens = [s.num_cached_tokens + n for s, n in zip(rest, query_lens)]
            tables, seq_slots = [s.block_table for s in rest], [s.seq_slot for s in rest]
            if self.fast_prefill:
                phost = self.fast.prefill_host(query_lens, context_lens, tables, seq_slots, self.model.args.num_heads)
                prefill = self.fast.prefill_inputs(phost)
                positions += phost["positions"].tolist()
            else:
                meta = AttnMetadata.build(query_lens=query_lens, context_lens=context_lens, block_tables=tables,
                                          block_size=self.block_size, seq_ids=[s.seq_id for s in rest],
                                          device=self.device, seq_slots=seq_slots)
            ids += [t for s, n in zip(rest, query_lens) for t in s.token_slice(s.num_cached_tokens, s.num_cached_tokens + n)]
        ids_t = to_device(ids, torch.long, self.device)  # no wait: in a split step the decode graph is running
        if pending_ids is not None:
            ids_t[: len(pending_ids)] = pending_ids
        pos_t = to_device(positions, torch.long, self.device)
        if meta is not None:
            pos_t = torch.cat((pos_t, meta.positions))

        def attention(layer: int, q, k, v, rotated: bool = False):
            cache = self.caches[layer]
            parts = []
            if num_decode:
                parts.append(self.fast.decode(cache, q[:num_decode], k[:num_decode], v[:num_decode], inputs,
                                              rotated))
            if prefill is not None:
                parts.append(self.fast.prefill(cache, q[num_decode:], k[num_decode:], v[num_decode:], prefill,
                                               rotated))
            elif meta is not None:
                parts.append(reference_paged_attention(q[num_decode:], k[num_decode:], v[num_decode:], cache,
                                                       self.kv_format, meta))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        # the reference path rotates its own q and k
        attention.rotates_qk = self.fast is not None and self.fast.rotates_qk and meta is None
        hidden = self.model(ids_t, pos_t, attention)
        last = torch.arange(num_decode, device=self.device)
        if rest:
            ends = torch.cumsum(to_device(query_lens, torch.long, self.device), 0) - 1 + num_decode
            last = torch.cat((last, ends))
        return self.model.compute_logits(hidden[last])


def prepare_model(model, plan: EnginePlan) -> None:
    """The plan's weight format, merged projections and fused ops, applied in place before any profiling
    or graph capture."""
    model.requires_grad_(False)  # the engine only samples; weights arrive via load_weights
    if plan.weights.value == "fp8":
        from kv4rl.engine.fp8_weights import apply_fp8_weights

        apply_fp8_weights(model)
    if plan.merge_projections.value:  # after the FP8 swap: merges FP8 codes and scales as they are
        from kv4rl.engine.merged_linears import merge_projections

        merge_projections(model)
    if plan.fused_ops.value:
        model.enable_fused_ops()
    if plan.fused_fp8_quant:  # FP8 linears quantize their inputs in one kernel too
        from kv4rl.engine.fp8_weights import set_fused_quant

        set_fused_quant(model, decode_gemm=plan.fp8_gemm.value == "triton")
    if plan.weights.value == "fp8":
        from kv4rl.engine.fp8_weights import fp8_path

        param = next(model.parameters())
        assert fp8_path(model, param.dtype, param.device) == plan.weights.reason, "the plan mistook the FP8 path"


def _pool_too_large(kv_format: KVFormat, args, num_blocks: int, block_size: int, max_num_seqs: int,
                    device: torch.device) -> ValueError:
    """A pool the device cannot hold, named by its settings and size (the allocator's traceback said neither)."""
    from kv4rl.engine.memory import format_bytes, kv_footprint

    size = kv_footprint(kv_format, args.num_layers, args.num_kv_heads, args.head_dim,
                        block_size).total_bytes(num_blocks, max_num_seqs)
    return ValueError(f"the KV pool of {num_blocks} blocks x {block_size} tokens ({kv_format.name}, "
                      f"{format_bytes(size)} over {args.num_layers} layers) does not fit in {device.type} memory: "
                      f"lower engine.num_kv_blocks or engine.kv.block_size (engine.num_kv_blocks=null sizes the "
                      f"pool from memory on CUDA)")
