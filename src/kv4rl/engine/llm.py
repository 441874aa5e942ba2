"""The engine facade: requests in, completions with behaviour log-probs and versions out.

`Engine.generate(prompts, params)` runs to completion (`generate_each` hands each completion over as it
finishes, with a bounded number of requests in the engine); `add_request` / `step` expose the
continuous-batching loop for orchestration that keeps requests alive across weight updates.
`load_weights(state_dict, version)` copies learner weights in place and tags later tokens.
`sleep()` / `wake()` free and re-allocate the KV pool and decode graphs around a learner update on
the same device; unfinished requests survive by recomputation (see `Engine.sleep`).
`score_tokens(prompts, forced)` teacher-forces given responses through the same cache path and
returns full-vocabulary logits (the fidelity bench compares KV formats with it). The whole calls
(`generate`, `generate_each`, `score_tokens`) live in `kv4rl.engine.batch_calls`, the weights' loads and
saves in `kv4rl.engine.weights`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kv4rl.engine.batch_calls import BatchCalls
from kv4rl.engine.block_manager import BlockManager
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.host_copy import to_device
from kv4rl.engine.placement import place_model
from kv4rl.engine.plan import make_plan, probe_capabilities
from kv4rl.engine.runner import ModelRunner
from kv4rl.engine.sampler import as_int64, request_seed
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.summary import engine_summary
from kv4rl.engine.run_ahead import LaunchedStep, copy_to_host, rows_ahead, schedule_ahead, tally
from kv4rl.engine.weights import EngineWeights
from kv4rl.engine.sleep_wake import EngineSleep
from kv4rl.engine.sequence import PENDING_TOKEN, Completion, SamplingParams, Sequence, Status
from kv4rl.models.decoder import Decoder
from kv4rl.models.tensor_parallel import tensor_parallel_group

log = logging.getLogger(__name__)
MAX_DRAINED_STEPS = 1024  # records kept for `take_drained_steps`


class Engine(BatchCalls, EngineWeights, EngineSleep):
    def __init__(
        self,
        model_dir: str | Path | None,
        config: EngineConfig | None = None,
        *,
        max_num_seqs: int = 256,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        tokenizer: Any = None,
        model: Decoder | None = None,
        reserve_bytes: int = 0,
    ):
        """Load the checkpoint in `model_dir`, or take an in-memory `model` (see `from_model`); decide the
        `auto` settings (`kv4rl.engine.plan`) and let the runner carry them out on the device.
        `reserve_bytes`: device memory a pool sized from memory must leave free for what will be allocated
        after the engine starts: the update of a learner on the same device when the engine stays awake
        through it (`Learner.update_memory_bytes`); the start line names it."""
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        config = config or EngineConfig()
        config.validate()
        self.config = config
        self.tp = tensor_parallel_group(config.tensor_parallel)
        self.model, self.device, self.dtype = place_model(model_dir, model, device, dtype, self.tp)
        self.args = self.model.args
        self.tokenizer = tokenizer
        self.plan = make_plan(config, self.args, self.dtype, probe_capabilities(self.device), max_num_seqs)
        self.kv_format = self.plan.kv_format
        if self.tp.size > 1:
            self.kv_format.tensor_parallel = self.tp
        self.max_model_len = self.plan.max_model_len.value
        self.runner = ModelRunner.build(self.model, self.plan, config, self.device, reserve_bytes)
        self.scheduler = Scheduler(
            BlockManager(self.runner.num_blocks, config.kv.block_size), max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, prefix_sharing=config.prefix_sharing, chunked_prefill=config.chunked_prefill,
            admit_siblings_together=config.admit_siblings_together,
        )
        self.eos_ids = frozenset(self.args.eos_token_ids)
        self._stop_sets: dict[tuple[int, ...], frozenset[int]] = {}  # `_stop_ids`, per request stop ids
        self.generator = torch.Generator()  # only draws per-request seeds; sampling noise is counter-based
        self.generator.manual_seed(seed)
        self.version = 0
        self._user = threading.RLock()  # `exclusive`: one thread steps the engine at a time
        self.last_step: dict = {}
        self.step_was_read = False  # the last `step` read a step (`last_step` is its record), not only stopped ones
        # all layers, scales and KV4's reserved INT8 rows (spread over max_model_len) included
        self.bytes_per_token = self.kv_bytes_per_token(self.max_model_len)
        self.pool_tokens = self.runner.num_blocks * config.kv.block_size
        self.pool_bytes = self.runner.cache_bytes
        self.asleep = False
        self._torn_weights: str | None = None  # why the last load_weights stopped part-way (None: whole)
        self._inflight: LaunchedStep | None = None  # launched, tokens not read (async scheduling)
        self._backlog: list[Sequence] = []  # finished while draining, returned by the next step
        self._drained_steps: list[dict] = []  # `last_step` of each step a drain read (`take_drained_steps`)
        self._last_read = 0.0  # when the host last read a step's tokens (latency under async scheduling)
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens were read
        self.summary = engine_summary(self, max_num_seqs)
        log.info(self.summary)
        log.info("engine plan: %s", self.plan.explain())

    @classmethod
    def from_model(cls, model: Decoder, config: EngineConfig | None = None, **kwargs) -> Engine:
        """An engine around a decoder already in memory (e.g. random-init for a benchmark), on its device
        and in its dtype. The engine owns it from then on (weight formats transform it in place)."""
        return cls(None, config, model=model, **kwargs)

    # ---- what the plan decided ----------------------------------------------------------------
    @property
    def sampler(self) -> str:
        return self.plan.sampler.value

    @property
    def fused_ops(self) -> bool:
        return self.plan.fused_ops.value

    @property
    def async_scheduling(self) -> bool:
        """Steps launched before the previous one's tokens are read (`engine.async_scheduling`, resolved)."""
        return self.plan.async_scheduling.value

    @property
    def attention_desc(self) -> str:
        return self.plan.attention_desc

    @property
    def pool_sizing(self) -> str:
        return self.runner.pool_sizing

    def kv_bytes_per_token(self, context_len: int) -> float:
        """KV storage per token over all layers, K and V, scales and protected copies at `context_len`."""
        per_layer = self.kv_format.bytes_per_token(self.args.num_kv_heads, self.args.head_dim, context_len)
        return per_layer * self.args.num_layers

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, tag: Any = None,
                    sample_seed: int | None = None, resume_from: Completion | None = None) -> Sequence:
        """Queue one request. `sample_seed` (any int, taken modulo 2**64) fixes its random stream (default:
        `params.seed`'s, as `generate` gives its first request, else drawn from the engine's).

        `resume_from` continues a partially generated response (tokens, log-probs and versions kept);
        its KV is recomputed by the prefill. One that already meets a stop condition under `params` (its
        last token a stop token, `max_tokens` or `max_model_len` reached) generates nothing: it is
        finished at once with that reason and returned by the next `step`.
        """
        params.validate()
        prompt_ids = self.checked_ids(prompt_ids, "prompt")
        if not prompt_ids:
            raise ValueError("empty prompt")
        if sample_seed is None and params.seed is not None:
            sample_seed = request_seed(params.seed, 0)
        elif sample_seed is None:
            sample_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        seq = Sequence(list(prompt_ids), params, tag=tag, sample_seed=as_int64(sample_seed))
        if resume_from is not None:
            if not len(resume_from.token_ids) == len(resume_from.logprobs) == len(resume_from.versions):
                raise ValueError(f"resume_from holds {len(resume_from.token_ids)} tokens, {len(resume_from.logprobs)} "
                                 f"log-probs and {len(resume_from.versions)} versions: one of each per token")
            seq.output_ids = self.checked_ids(resume_from.token_ids, "resume_from's tokens")  # as a prompt's
            seq.output_logprobs = list(resume_from.logprobs)
            seq.output_versions = list(resume_from.versions)
            reason = self.scheduler.stop_reason(seq, self._stop_ids(params))
            if reason is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                self._backlog.append(seq)
                return seq
        self.scheduler.add(seq)
        return seq

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The EOS ids and the request's own stop ids (read per sequence per step: each set built once)."""
        extra = params.stop_token_ids
        if extra is None:
            return self.eos_ids
        key = extra if isinstance(extra, tuple) else tuple(extra)
        ids = self._stop_sets.get(key)
        if ids is None:
            if len(self._stop_sets) >= 1024:  # callers that vary their stop ids per request
                self._stop_sets.clear()
            ids = self._stop_sets[key] = self.eos_ids | frozenset(key)
        return ids

    def abort(self, seq: Sequence) -> None:
        """Remove an unfinished request (its blocks are freed); it is never returned by `step`."""
        self.drain()
        if seq in self._backlog:  # it stopped in the drain: aborted all the same
            self._backlog.remove(seq)
            seq.finish_reason = "abort"
            return
        self.scheduler.abort(seq)

    def recompute_all(self) -> None:
        """Drop every running sequence's KV so it is re-prefilled under the current weights."""
        self.drain()
        self.scheduler.preempt_all()

    def unfinished(self) -> list[Sequence]:
        """Requests queued or running, after reading the step in flight. Those that stopped in it are not
        among them: they are returned by the next `step`, or now by `take_stopped`."""
        self.drain()
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def take_stopped(self) -> list[Sequence]:
        """Requests that finished in a step read by a drain (a weight refresh, `unfinished`, ...), which the
        next `step` would return: handed over now instead, so a caller that checks or saves its requests
        between steps sees every one of them."""
        self.drain()
        stopped, self._backlog = self._backlog, []
        return stopped

    def num_unfinished(self) -> int:
        """Requests queued or running, counted without reading the step in flight (`unfinished` reads it):
        those that stop with its tokens still count, so a caller topping up the engine adds one step later
        instead of making the device wait for the host."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        """Requests queued or running, a step in flight or stopped requests not yet returned by `step`."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._backlog)

    @contextlib.contextmanager
    def exclusive(self, what: str):
        """Refuse a second thread: two threads stepping one engine interleaved their batches, and one was
        handed wrong tokens without an error (the same thread may re-enter: `generate` in `on_finish`)."""
        if not self._user.acquire(blocking=False):
            raise RuntimeError(f"{what}: the engine is in use by another thread (an Engine serves one thread at a "
                               "time; give each thread its own, or a lock around the calls)")
        try:
            yield
        finally:
            self._user.release()

    def step(self) -> list[Sequence]:
        """Advance every scheduled sequence by one token (or one prompt chunk); return the ones that finished.

        `last_step` afterwards describes the step for rollout traces (`LaunchedStep.record`).

        With `engine.async_scheduling` the next step is launched before this one's tokens are read when
        the batch can continue (`kv4rl.engine.run_ahead`), and otherwise right after they are read: a
        call returns with a step in flight whenever requests remain, whose tokens join at the next call
        (or `drain`); an EOS stop is reported one call later, and a request added between calls joins
        a step later. `latency_s` is then the time since the previous step's tokens were read."""
        with self.exclusive("step"):
            return self._step()

    def _step(self) -> list[Sequence]:
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV pool is freed); call wake() before stepping it")
        self._check_weights_whole()
        self.step_was_read = False
        finished, self._backlog = self._backlog, []
        try:
            self._advance(finished)
            return finished
        except BaseException:
            # a step that failed after its forward (sampling, a token read, Ctrl-C) left caches ahead of the
            # tokens: every later step then failed. The running sequences are re-prefilled instead, and the
            # stopped ones are still handed over by the next step
            self._backlog = finished + self._backlog
            self._recover()
            raise

    def _recover(self) -> None:
        """After a step or a drain that failed part-way: forget the step in flight, take back the places held
        for tokens it never read (async scheduling; re-prefilled, id -1 failed every later step), and
        re-prefill every running request under the current weights (the forward had moved their caches
        ahead of their tokens). The sampler's counter goes back with them: the same tokens are drawn again."""
        self._inflight = None
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            while seq.output_ids and seq.output_ids[-1] == PENDING_TOKEN:
                seq.output_ids.pop()
                seq.output_logprobs.pop()
                seq.output_versions.pop()
        self.scheduler.preempt_all()

    def _advance(self, finished: list[Sequence]) -> None:
        """The step's work; the requests that stopped in it go into `finished` as they are read."""
        launched = self._inflight
        if launched is None:
            if not self.scheduler.has_unfinished():
                return  # stopped during a drain (or an idle engine): nothing left to step
            launched = self._launch_scheduled()
        self._inflight = None
        rows = rows_ahead(self.scheduler, launched) if self.async_scheduling else None
        if rows is not None:
            self.num_steps_ahead += 1
            t1, saved = time.perf_counter(), self.scheduler.prefill_tokens_saved
            nxt, ids = schedule_ahead(self.scheduler, launched, rows, self.version)
            self._inflight = self._launch_step(nxt, t1, saved, pending_ids=ids)
        self._complete(launched, finished)
        self.step_was_read = True
        if self.async_scheduling and self._inflight is None and self.scheduler.has_unfinished():
            # it could not run ahead (a request may be admitted, one needs a block): launch the next step
            # now that the tokens are read, so the caller's work overlaps its device work
            self._inflight = self._launch_scheduled()

    def drain(self) -> None:
        """Read the step in flight (`engine.async_scheduling`; stopped ones are returned by the next `step`),
        before anything that changes what it relies on: weights, the pool, the running sequences."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            try:
                self._complete(launched, self._backlog)
            except BaseException:  # as in `step`: the requests re-prefill, none is lost
                self._recover()
                raise
            # its latency since the last read spans whatever the caller did meanwhile (a learner update):
            # only the wait for the device is the step's
            self._drained_steps.append({**self.last_step, "latency_s": self.last_step["wait_s"], "drained": True})
            del self._drained_steps[:-MAX_DRAINED_STEPS]  # an engine whose caller never takes them

    def take_drained_steps(self) -> list[dict]:
        """The records (`last_step`) of the steps drains read since the last call, oldest first: real steps
        of the caller's requests that no `step` call returned, for a trace that counts every step."""
        steps, self._drained_steps = self._drained_steps, []
        return steps

    def _launch_scheduled(self) -> LaunchedStep:
        """Schedule the next batch from the scheduler's current state and queue it."""
        started, saved = time.perf_counter(), self.scheduler.prefill_tokens_saved
        return self._launch_step(self.scheduler.schedule(), started, saved)

    def _launch_step(self, seqs: list[Sequence], started_at: float, saved_before: int,
                     pending_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Queue a scheduled batch's forward and sampling (scheduled from `started_at` on, when the
        scheduler's count of prompt tokens saved by forks was `saved_before`); the host does not wait."""
        if not seqs:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        rows, stats = tally(seqs, self.scheduler.blocks, saved_before)
        sampled = [seqs[i] for i in rows]
        tokens, logprobs = self._launch(seqs, rows, sampled, pending_ids)
        readable, ready = (tokens, logprobs), None
        if self.async_scheduling and self.device.type == "cuda" and sampled:
            *readable, ready = copy_to_host(tokens, logprobs)
        return LaunchedStep(seqs, sampled, tokens, *readable, ready, stats, launched_at=started_at)

    def _launch(self, seqs: list[Sequence], rows: list[int], sampled: list[Sequence],
                pending_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's device work, the forward and the sampling of `rows`, queued without the host waiting
        for any of it (tests/gpu/test_engine_no_host_wait_gpu.py checks this under CUDA's sync debug
        mode), so the step's one wait is the read of its tokens and `wait_s` measures it."""
        logits = self.runner.forward(seqs, pending_ids)
        if not sampled:
            return torch.empty(0), torch.empty(0)
        if len(rows) < len(seqs):
            logits = logits[to_device(rows, torch.long, logits.device)]
        return self.runner.sample(sampled, logits)

    def _complete(self, launched: LaunchedStep, finished: list[Sequence]) -> None:
        """Read a launched step's tokens into its sequences, finish the ones that stop (into `finished` at
        once: a failure later in the step loses none of them); `last_step`."""
        tokens, logprobs, wait = launched.read()
        pending, running = launched.pending, Status.RUNNING
        for seq, tok, lp in zip(launched.sampled, tokens, logprobs):
            if seq.status is not running:
                continue  # stopped at the step before (run ahead): this row was computed and is dropped
            if pending:
                seq.resolve_pending(tok, lp)
            else:
                seq.append(tok, lp, self.version)
            reason = self.scheduler.stop_reason(seq, self._stop_ids(seq.params))
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        if self._inflight is None:  # nothing queued behind it: the step's whole device work is done
            t_wait = time.perf_counter()
            self.runner.synchronize()
            wait += time.perf_counter() - t_wait
        now = time.perf_counter()
        # the engine's resident KV, every tensor-parallel shard's (each holds its share of the KV heads)
        self.last_step = launched.record(self.bytes_per_token * self.tp.size, self.scheduler.prefill_tokens_saved,
                                         latency=now - max(launched.launched_at, self._last_read), wait=wait)
        self._last_read = now

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_shared_blocks(self) -> int:
        """KV blocks held by more than one running sequence right now (prefix sharing)."""
        return self.scheduler.blocks.num_shared_blocks

    @property
    def num_prefill_tokens_saved(self) -> int:
        """Prompt tokens, over the engine's life, that forked requests did not prefill."""
        return self.scheduler.prefill_tokens_saved
