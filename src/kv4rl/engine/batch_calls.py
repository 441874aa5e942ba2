"""Whole calls on the engine's request loop (`add_request` / `step`): `generate` (every prompt to completion,
results in input order), `generate_each` (each completion handed over as it finishes, a bounded number of
requests in the engine), `score_tokens` (teacher forcing), and the checks of what a call may ask for.
`Engine` takes them as a mixin; they use its queue, backlog and drained-step records."""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Any

import torch

from kv4rl.engine.sampler import request_seed
from kv4rl.engine.sequence import Completion, SamplingParams, Sequence, Status
from kv4rl.engine.teacher_forcing import score_forced


class BatchCalls:
    def generate(
        self,
        prompts: Iterable[list[int] | str],
        params: SamplingParams | None = None,
        tags: Iterable[Any] | None = None,
        progress: Any = None,
        sample_seeds: list[int] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion; results in input order. `progress(n_done)` is called per finish.

        Requests already in the engine (a collector's partial rollouts) wait while it runs: the running ones
        are preempted (their KV recomputed when they go on, as after `sleep`) and all are queued again ahead
        of anything else afterwards, so a periodic eval neither advances them nor moves the batch boundaries
        of the rollout it interrupts. One that stopped before (in the step in flight) is returned by the
        `step` after `generate`.
        (Stepping them along, generate returned their completions to nobody, and their groups were lost.)

        `sample_seeds` (one per prompt) fixes each request's random stream and takes precedence over
        `params.seed`, so a prompt samples the same tokens whatever else is in the call (a sharded eval
        seeds by the problem's place in the whole set)."""
        prompts = list(prompts)
        out: list[Completion | None] = [None] * len(prompts)

        def keep(index: int, completion: Completion) -> None:
            out[index] = completion

        self.generate_each(prompts, params, keep, tags=tags, progress=progress, sample_seeds=sample_seeds)
        return out  # type: ignore[return-value]  (every place filled: the call ran every request)

    def generate_each(
        self,
        prompts: Iterable[list[int] | str],
        params: SamplingParams | None,
        on_finish: Any,
        *,
        tags: Iterable[Any] | None = None,
        progress: Any = None,
        sample_seeds: list[int] | None = None,
        max_in_engine: int | None = None,
        group: int = 1,
    ) -> None:
        """`generate`, handing each completion to `on_finish(index, completion)` as it finishes (finish order)
        instead of returning them all at the end, with at most `max_in_engine` of the call's requests in the
        engine at once (queued or running; None: all), added in input order `group` at a time (a problem's
        samples, so they share one prompt prefill). The host then holds the tokens of at most that many
        requests: an eval of 30 problems x 1,024 samples x 8k tokens held ~25 GB of token lists in one
        `generate`. Each request's tokens are those `generate` samples (its own seed, counter-based noise).
        Parking of requests already in the engine, and the cleanup on an error (in `on_finish` too), as in
        `generate`. Every prompt is checked against the context and the pool before any request runs.
        `on_finish` must not add requests to the engine (the call's steps would return them)."""
        params = params or SamplingParams()
        prompts = list(prompts)
        tags = list(tags) if tags is not None else [None] * len(prompts)
        if len(tags) != len(prompts):
            raise ValueError(f"generate got {len(tags)} tags for {len(prompts)} prompts")
        if sample_seeds is not None:
            seeds = list(sample_seeds)
            if len(seeds) != len(prompts):
                raise ValueError(f"generate got {len(seeds)} sample seeds for {len(prompts)} prompts")
            odd = next((x for x in seeds if not isinstance(x, int) or isinstance(x, bool)), None)
            if odd is not None:
                raise ValueError(f"sample seeds must be integers, got {odd!r}")
        elif params.seed is None:
            seeds = [None] * len(prompts)
        else:
            seeds = [request_seed(params.seed, i) for i in range(len(prompts))]
        if group < 1 or (max_in_engine is not None and max_in_engine < group):
            raise ValueError(f"generate_each needs 1 <= group <= max_in_engine, got group={group}, "
                             f"max_in_engine={max_in_engine}")
        encoded = [self._encode(p) for p in prompts]
        params.validate()  # bad input is refused before any request is parked
        if not all(encoded):
            raise ValueError("empty prompt")
        for ids in encoded:  # every request checked before any runs: the window adds the last ones late
            self.scheduler.check_fits(len(ids), params.max_tokens)
        window = len(encoded) if max_in_engine is None else max_in_engine
        with self.exclusive("generate"):
            self._generate_encoded(encoded, params, on_finish, tags, seeds, progress, window, group)

    def _generate_encoded(self, encoded, params, on_finish, tags, seeds, progress, window, group) -> None:
        """`generate_each`'s run of its checked requests, with the engine held by this thread."""
        parked, stopped = self._park_requests()
        drained = len(self._drained_steps)  # this call's own steps are not the caller's: dropped below
        live: dict[int, tuple[int, Sequence]] = {}  # id(seq) -> (its place in `prompts`, the request)
        added = done = 0
        try:
            while done < len(encoded):  # only this call's requests run, so every one a step returns is its own
                while added < len(encoded) and len(live) + min(group, len(encoded) - added) <= window:
                    for i in range(added, min(added + group, len(encoded))):
                        seq = self.add_request(encoded[i], params, tags[i], seeds[i])
                        live[id(seq)] = (i, seq)
                    added = min(added + group, len(encoded))
                for seq in self.step():
                    index, _ = live.pop(id(seq))
                    completion = Completion.from_sequence(seq)
                    if self.tokenizer is not None:
                        completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                    done += 1
                    on_finish(index, completion)
                if progress is not None:
                    progress(done)
        except BaseException:
            for _, seq in live.values():  # none of this call's requests outlives it
                if seq.status is not Status.FINISHED:
                    self.abort(seq)
            raise
        finally:
            # read a step still in flight (launched ahead of this call's last tokens, or by an abort above):
            # it must not be the caller's next step, and none of this call's requests is handed to the caller
            self.drain()
            del self._drained_steps[drained:]
            self.scheduler.waiting.extendleft(reversed(parked))
            self._backlog = stopped + [seq for seq in self._backlog if id(seq) not in live]

    def _park_requests(self) -> tuple[list[Sequence], list[Sequence]]:
        """For `generate`: every unfinished request out of the queue (the running ones preempted first), and
        those that stopped in the step in flight out of the backlog, for the `step` after `generate`
        (its own steps would return them to nobody)."""
        self.drain()
        stopped, self._backlog = self._backlog, []
        self.scheduler.preempt_all()
        parked = list(self.scheduler.waiting)
        self.scheduler.waiting.clear()
        return parked, stopped

    @torch.inference_mode()
    def score_tokens(self, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
        """Teacher forcing: for each prompt, float32 logits[T, V] of its forced tokens, row t given
        `prompt + forced[:t]` (`kv4rl.engine.teacher_forcing`)."""
        self._check_weights_whole()
        self.drain()  # it steps the scheduler and the runner itself
        return score_forced(self, prompts, forced)

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need an Engine built with a tokenizer")
            # as the tokenizer encodes by default (its BOS where it adds one), as vLLM's generate does: without
            # it a Llama-3 base model was prompted with no <|begin_of_text|>
            return self.checked_ids(self.tokenizer.encode(prompt), "prompt")
        return self.checked_ids(prompt, "prompt")

    def checked_ids(self, ids: Iterable[int], what: str) -> list[int]:
        """`ids` as Python ints, refused (ValueError naming it) unless each is an integer token id of the model's
        vocabulary: an id past it failed deep inside the embedding (on CUDA, a device-side assert that ends
        the process's CUDA context) and a float id was taken as its integer part."""
        # a tensor or an array whole (iterating one makes a 0-d tensor of each element: 48 ms for 8k ids)
        ids = ids.tolist() if hasattr(ids, "tolist") and not isinstance(ids, list) else list(ids)
        if not isinstance(ids, list):
            raise ValueError(f"{what} must be a list of integer token ids, got {ids!r}")
        if not ids:
            return ids
        try:  # each through __index__: Python, NumPy and 0-d tensor integers pass, a float or a list does not
            codes = array.array("q", ids)
        except (TypeError, OverflowError):
            raise ValueError(f"{what} must be a list of integer token ids, got {ids[:6]!r}"
                             f"{'...' if len(ids) > 6 else ''}") from None
        low, high, vocab = min(codes), max(codes), self.args.vocab_size
        if low < 0 or high >= vocab:
            raise ValueError(f"{what} holds token id {low if low < 0 else high}, outside the model's vocabulary "
                             f"(0..{vocab - 1})")
        return codes.tolist()  # ~40 us for 512 ids on a 2-core host (a tensor round trip took 75)
