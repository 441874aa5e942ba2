"""Per-request state of the rollout engine (torch-free, so the scheduler can be tested alone)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any


# the smallest positive temperature: float32 logits / 1e-5 stay finite. Below ~1e-3 the float32 division
# itself rounds: recorded log-probs are those of the float32-scaled logits the token was drawn from (and the
# learner scores alike), up to 0.07 nats from float64's softmax(z / T) at 1e-5
MIN_TEMPERATURE = 1e-5


def temperature_problem(name: str, value: float, greedy: bool = True) -> str | None:
    """Why `value` cannot be the sampling temperature `name` (None: it can): 0 means greedy where `greedy`
    allows it; otherwise it must be finite and at least MIN_TEMPERATURE (below it, or NaN, the scaled
    logits overflow and every log-prob is NaN)."""
    if greedy and value == 0:
        return None
    if MIN_TEMPERATURE <= value < float("inf"):
        return None
    allowed = f"0 (greedy) or at least {MIN_TEMPERATURE}" if greedy else f"at least {MIN_TEMPERATURE}"
    return f"{name} must be {allowed} and finite, got {value}"


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` is greedy; `top_k <= 0`, `top_p == 1` and `min_p == 0` are
    off (`min_p`: keep the tokens at least `min_p` times as likely as the likeliest, before top-k / top-p, as vLLM).

    The engine reports each token's log-prob under the distribution it actually sampled from
    (temperature-scaled and truncated), so RL with the defaults sees the exact behaviour policy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] | None = None  # stop at these too, besides the model's EOS ids (as vLLM)
    ignore_eos: bool = False  # no stop token ends it (the EOS ids or `stop_token_ids`), only the length limits
    seed: int | None = None  # request i of generate() samples with `request_seed(seed, i)`, whatever else runs;
    # add_request() with no `sample_seed` samples as generate()'s request 0

    def validate(self) -> None:
        problem = temperature_problem("temperature", self.temperature)
        if problem:
            raise ValueError(problem)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p}")
        for name in ("top_k", "max_tokens") + (("seed",) if self.seed is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if abs(self.top_k) >= 2**63:  # an int64 on the device: it overflowed inside a step, after its forward
            raise ValueError(f"top_k must be below 2**63 (any value >= the vocabulary keeps every token), got "
                             f"{self.top_k}")
        if self.stop_token_ids is not None and (
                isinstance(self.stop_token_ids, (int, str, bytes)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()
PENDING_TOKEN = -1  # the place of a sampled token the host has not read yet (never a vocabulary id)


@dataclass(slots=True)
class PrefixFork:
    """Cache copies the runner makes before the first forward of a sequence forked from a parent
    that holds the same prompt: the shared positions of the partly shared block (copy-on-write,
    cache slots `src_slots` -> `dst_slots`) and the parent's per-sequence rows (KV4's protected copies).
    """

    src_slots: list[int]
    dst_slots: list[int]
    src_seq_slot: int
    dst_seq_slot: int


@dataclass(eq=False, slots=True)
class Sequence:
    """Prompt, sampled tokens with their behaviour log-probs and policy versions, and KV blocks.

    Invariant while running: the KV of the first `num_cached_tokens` tokens is in the cache; the
    newest sampled token is not (its KV is written by the next step).
    """

    prompt_ids: list[int]
    params: SamplingParams
    tag: Any = None
    sample_seed: int = 0  # counter-based sampling: token t's noise depends on (sample_seed, t) only
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    seq_slot: int = -1  # running slot (0..max_num_seqs-1) owning per-sequence cache rows; -1 when not running
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    table_epoch: int = 0  # bumped when `block_table` is freed (it only grows by appends in between)
    fork: PrefixFork | None = None  # set by the scheduler, applied and cleared by the runner
    chunk: int = 0  # chunked prefill: new tokens the next forward computes (0: all of them), set per step
    prompt_key: bytes | None = field(default=None, repr=False)  # the prompt as bytes, set by the scheduler

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """The newest token, without building `token_ids` (a copy of the whole sequence)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]`, copying only that slice."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt:stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[:stop - prompt]

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose KV the next forward must compute."""
        return len(self) - self.num_cached_tokens

    @property
    def num_step_tokens(self) -> int:
        """Tokens the next forward computes: all new tokens, or the scheduler's chunk of a long prefill."""
        new = self.num_new_tokens
        return min(new, self.chunk) if self.chunk else new

    def step_counts(self) -> tuple[int, int, int]:
        """(`len(self)`, `num_new_tokens`, `num_step_tokens`) in one call: the scheduler, the runner and
        the step's tally read them for every row of every step, where chained properties cost host time."""
        length = len(self.prompt_ids) + len(self.output_ids)
        new = length - self.num_cached_tokens
        return length, new, (min(new, self.chunk) if self.chunk else new)

    @property
    def samples_this_step(self) -> bool:
        """The next forward reaches the newest token, so its logits give the next token to sample."""
        return self.num_step_tokens == self.num_new_tokens

    def append(self, token_id: int, logprob: float, version: int) -> None:
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)

    def append_pending(self, version: int) -> None:
        """Hold the place of a token sampled on the device and not read yet (`engine.async_scheduling`:
        the next step is scheduled and launched first, its input id taken on the device), so lengths,
        positions and the sampler's counter already count it. `resolve_pending` fills it in."""
        self.append(PENDING_TOKEN, float("nan"), version)

    def resolve_pending(self, token_id: int, logprob: float) -> None:
        assert self.output_ids and self.output_ids[-1] == PENDING_TOKEN, "no pending token to resolve"
        self.output_ids[-1] = token_id
        self.output_logprobs[-1] = logprob


@dataclass(slots=True)
class Completion:
    """What `Engine.generate` returns for one request."""

    seq_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    tag: Any = None
    text: str | None = None

    @classmethod
    def from_sequence(cls, seq: Sequence) -> Completion:
        return cls(
            seq_id=seq.seq_id,
            prompt_ids=list(seq.prompt_ids),
            token_ids=list(seq.output_ids),
            logprobs=list(seq.output_logprobs),
            versions=list(seq.output_versions),
            finish_reason=seq.finish_reason or "unknown",
            tag=seq.tag,
        )
