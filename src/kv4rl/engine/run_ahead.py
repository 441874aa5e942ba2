"""Asynchronous scheduling (`engine.async_scheduling`): schedule and launch step n+1 before reading step n.

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

The batch continues unchanged when every running sequence sampled at step n, none stops by length
with that token (max_tokens, the context), no queued request could be admitted (none waits, or every
slot is taken), and the free blocks cover each sequence's next block: then the scheduler's next batch
is the same rows and nothing is preempted. Otherwise step n is read first, as without the option.
Tokens are those of the synchronous engine: sampling noise depends on (request seed, position) only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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
    stats: dict = field(default_factory=dict)  # the step's tally for `Engine.last_step`
    launched_at: float = field(default_factory=time.perf_counter)
    pending: bool = False  # the sampled rows hold a pending token for this step's samples

    def read(self) -> tuple[list[int], list[float], float]:
        """The sampled tokens and log-probs as lists, and the seconds the host waited for them."""
        t = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()  # blocks until sampled (sync path)
        return tokens, logprobs, time.perf_counter() - t


def copy_to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """Queue copies of a step's samples into pinned memory, and an event behind them."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, logprobs)]
    for dst, src in zip(host, (tokens, logprobs)):
        dst.copy_(src, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host[0], host[1], ready


def can_run_ahead(scheduler: Scheduler, step: LaunchedStep) -> bool:
    """Whether the next batch is `step`'s sampled rows unchanged (see the module docstring)."""
    running = scheduler.running
    if not step.sampled or len(running) != len(step.sampled):
        return False
    if scheduler.waiting and len(running) < scheduler.max_num_seqs:
        return False  # a queued request could be admitted: its prompt joins the batch
    block_size, new_blocks = scheduler.blocks.block_size, 0
    for seq, ran in zip(running, step.sampled):
        if seq is not ran or seq.status is not Status.RUNNING:
            return False
        length = len(seq) + 1  # with this step's token
        if len(seq.output_ids) + 1 >= seq.params.max_tokens or length >= scheduler.max_model_len:
            return False  # it stops by length with this step's token
        new_blocks += len(seq.block_table) * block_size < length
    return new_blocks <= scheduler.blocks.num_free_blocks
