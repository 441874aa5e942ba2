"""A launched engine step (its tally, its token read, its record), and asynchronous scheduling
(`engine.async_scheduling`): schedule and launch step n+1 before reading step n.

Why: a synchronous step schedules, builds its inputs and launches only after the host has read the
previous step's tokens, so the device idles while the host works. On an H200 at the Qwen3-1.7B shape
the host part was 1.9-3.7 ms of every 4.6-6.6 ms decode step (bench/RESULTS.md, seventh session).
Running one step ahead overlaps the two, as vLLM's and SGLang's asynchronous schedulers do.

How: when step n's batch can continue unchanged, every sampling row gets a pending token
(`Sequence.append_pending`: lengths, positions and the sampler's counter count it), step n+1 is
scheduled (the same sequences, in the same order) and launched with its input ids taken on the device
from step n's sampled tokens, and only then does the host wait for step n's tokens (copied to pinned
memory behind step n's sampler), fill them in and check the stops. A sequence that stops at step n
(EOS) is finished then; its row in step n+1 is computed and dropped. Its blocks and slot may go to a
request admitted at step n+2, whose kernels run after step n+1's on the same stream.

The batch continues when every running sequence sampled at step n, no queued request could be
admitted (none waits, every slot is taken, or the queue's head is a group waiting for the slots of all
its siblings: `Scheduler.admits_nothing_next`), and the free blocks cover each continuing sequence's
next block: then the scheduler's next batch is the same rows less those that stop by length with
step n's token (max_tokens, the context; known before the token is), and nothing is preempted. Those
are finished when step n is read; a request waiting for their slots is admitted one step later than
without the option. Otherwise step n is read first, as without the option. Tokens are those of the
synchronous engine: sampling noise depends on (request seed, position) only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kv4rl.engine.block_manager import BlockManager
from kv4rl.engine.host_copy import to_device
from kv4rl.engine.scheduler import Scheduler
from kv4rl.engine.sequence import Sequence, Status


@dataclass(eq=False)
class LaunchedStep:
    """A step whose device work is queued and whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]  # the batch
    sampled: list[Sequence]  # the rows that sample, in the order of the tokens
    device_tokens: torch.Tensor  # [len(sampled)] where sampled: the next step's input ids when it runs ahead
    tokens: torch.Tensor  # what the host reads: the same tensors, or pinned copies final once `ready`
    logprobs: torch.Tensor
    ready: torch.cuda.Event | None  # recorded behind the copies to pinned memory (CUDA, run-ahead)
    stats: dict  # the step's tally (`tally`) for `Engine.last_step`
    launched_at: float  # when its scheduling began
    pending: bool = False  # the sampled rows hold a pending token for this step's samples

    def record(self, bytes_per_token: float, saved_now: int, latency: float, wait: float) -> dict:
        """`Engine.last_step` for this step, once read: batch size, new (prefill + decode) tokens and of
        them those of multi-token rows (`prefill_tokens`: prompts, chunks, recomputes), mean context
        length, nominal resident KV bytes, KV blocks in use and how many are shared, prompt tokens that
        prefix sharing saved, latency, and `wait_s`, the part of it the host spent waiting for the
        device's results (the rest is host work: scheduling, inputs, launches, bookkeeping; ~0 wait on
        the CPU). Only the token read waits (`Engine._launch` does not), so the wait is all there.
        Every running sequence was scheduled (`schedule` preempts those it cannot step), so the resident
        tokens are the batch's, the finished ones' included; each sampling row grew by its token."""
        stats, context = self.stats, self.stats["context"] + len(self.sampled)
        return {
            "batch_size": len(self.seqs),
            "new_tokens": stats["new_tokens"],
            "prefill_tokens": stats["prefill_tokens"],
            "context_mean": context / len(self.seqs),
            "kv_bytes": context * bytes_per_token,
            "kv_blocks": stats["kv_blocks"],
            "shared_blocks": stats["shared_blocks"],
            "prefill_tokens_saved": saved_now - stats["saved"],
            "latency_s": latency,
            "wait_s": wait,
        }

    def read(self) -> tuple[list[int], list[float], float]:
        """The sampled tokens and log-probs as lists, and the seconds the host waited for them."""
        t = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()  # blocks until sampled (sync path)
        return tokens, logprobs, time.perf_counter() - t


def tally(seqs: list[Sequence], blocks: BlockManager, saved_before: int) -> tuple[list[int], dict]:
    """A scheduled batch's rows that sample (not a prompt chunk short of its end) and its counts for
    `LaunchedStep.record`, in one pass: per-step host work at every batch size."""
    new_tokens = prefill_tokens = context = 0
    rows = []
    for i, s in enumerate(seqs):
        length, new, step = s.step_counts()
        new_tokens += step
        prefill_tokens += step if new > 1 else 0
        context += length
        if step == new:
            rows.append(i)
    return rows, {"kv_blocks": blocks.num_blocks - blocks.num_free_blocks, "shared_blocks": blocks.num_shared_blocks,
                  "saved": saved_before, "new_tokens": new_tokens, "prefill_tokens": prefill_tokens, "context": context}


def copy_to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """Queue copies of a step's samples into pinned memory, and an event behind them."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, logprobs)]
    for dst, src in zip(host, (tokens, logprobs)):
        dst.copy_(src, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host[0], host[1], ready


def rows_ahead(scheduler: Scheduler, step: LaunchedStep) -> list[int] | None:
    """The rows of `step.sampled` that form the next batch when it can be launched before `step`'s
    tokens are read (those that do not stop by length with this step's token), or None when it cannot
    (see the module docstring)."""
    running = scheduler.running
    if not step.sampled or len(running) != len(step.sampled):
        return None
    if not scheduler.admits_nothing_next():
        return None  # a queued request may be admitted: its prompt joins the batch
    block_size, new_blocks, rows = scheduler.blocks.block_size, 0, []
    for i, (seq, ran) in enumerate(zip(running, step.sampled)):
        if seq is not ran or seq.status is not Status.RUNNING:
            return None
        length = len(seq) + 1  # with this step's token
        if len(seq.output_ids) + 1 >= seq.params.max_tokens or length >= scheduler.max_model_len:
            continue  # it stops by length with this step's token: not in the next batch
        rows.append(i)
        new_blocks += len(seq.block_table) * block_size < length
    return rows if rows and new_blocks <= scheduler.blocks.num_free_blocks else None


def schedule_ahead(scheduler: Scheduler, step: LaunchedStep, rows: list[int], version: int
                   ) -> tuple[list[Sequence], torch.Tensor]:
    """Give `step`'s sampled rows their pending token and schedule the next batch, its `rows` (from
    `rows_ahead`; the others stop by length with this token and are left out); returns the batch and
    its input ids, `step`'s sampled tokens of those rows, on the device."""
    for seq in step.sampled:
        seq.append_pending(version)
    step.pending = True
    keep, ids, stopping = step.sampled, step.device_tokens, frozenset()
    if len(rows) < len(keep):
        keep = [keep[i] for i in rows]
        stopping = {id(s) for s in step.sampled} - {id(s) for s in keep}
        ids = ids[to_device(rows, torch.long, ids.device)]
    batch = scheduler.schedule(skip=stopping)  # the kept rows: rows_ahead checked nothing else changes
    assert len(batch) == len(keep) and all(a is b for a, b in zip(batch, keep))
    return batch, ids
