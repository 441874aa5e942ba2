"""Where each iteration's problems come from: the embedded task or a dataset file (JSON Lines or Parquet).

Any dataset file (for training or for evaluation) makes the run a dataset run: its default prompt is
the boxed-answer instruction and its default reward is math-verify, because real answers (`18`,
`\\frac{\\pi}{2}`) are only scored right when the model boxes them and the check compares maths,
not strings. Only a run with no file at all uses the embedded task's own template and exact match.

The training stream is indexed: problem `i` is a pure function of (seed, i), so a resumed run sees
exactly the prompts an uninterrupted run would have, with no sampler state to checkpoint.
The embedded task is the arithmetic task, or the task a testbed model was built for
(`kv4rl.models.testbed`: the loop passes it in), with the same template and exact reward.
It trains on a fixed pool of distinct problems (like a dataset's train split,
revisited each epoch), or on fresh problems forever with `pool_size = 0`; its evaluation problems
never overlap the pool.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable

from kv4rl.data.datasets import read_problems
from kv4rl.data.longmul import LongMulTask
from kv4rl.data.synthetic import PROMPT_TEMPLATE as ARITH_TEMPLATE
from kv4rl.data.synthetic import ArithmeticTask
from kv4rl.data.types import Problem

EmbeddedTask = ArithmeticTask | LongMulTask  # both prompt with `{problem}=` and answer one boxed integer
BOXED_INSTRUCTION = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
_CHUNK = 1024
DEFAULT_POOL_SIZE = 512
EVAL_SEED_OFFSET = 7_919_000  # keeps embedded eval problems disjoint in seed space from training draws


def default_prompt_template(embedded: bool) -> str:
    """The prompt template when `data.prompt_template` is null: the embedded task's `{problem}=`, or the boxed
    instruction for dataset files."""
    return ARITH_TEMPLATE if embedded else BOXED_INSTRUCTION


class ProblemSource:
    def __init__(self, train_path: str | None, eval_path: str | None, seed: int, shuffle: bool = True,
                 pool_size: int = DEFAULT_POOL_SIZE, task: EmbeddedTask | None = None,
                 max_prompt_tokens: int | None = None, prompt_format: list | None = None):
        """`task`: the embedded task (default: the arithmetic task), used when there is no training file.
        `max_prompt_tokens`: the files' rows with longer prompts are dropped by `drop_long_prompts`, lengths measured
        in `prompt_format` (data.prompt_template, data.chat_template), which the fingerprint records with it."""
        self.train_embedded = train_path is None  # the training stream is the embedded task
        self.embedded = train_path is None and eval_path is None  # no dataset file at all
        self.seed = seed
        self.shuffle = shuffle
        self.embedded_task = task if task is not None else ArithmeticTask()
        self.task = self.embedded_task if self.train_embedded and pool_size == 0 else None
        self.layouts: dict[str, str] = {}  # each file's layout by its key ("jsonl", "parquet", "verl")
        if self.train_embedded:
            self.train = _distinct(self.embedded_task, pool_size, seed) if pool_size else None
        else:
            self.train, self.layouts["data.train"] = read_problems(train_path)
        self.eval_file = None
        if eval_path is not None:
            self.eval_file, self.layouts["data.eval"] = read_problems(eval_path)
        self.max_prompt_tokens, self.prompt_format = max_prompt_tokens, prompt_format
        self._prompts_limited = False  # `drop_long_prompts` done: a second call reads no prompt again
        self._chunk: tuple[int, list[Problem]] = (-1, [])  # the last task chunk / epoch order used
        self._order: tuple[int, list[int]] = (-1, [])
        self._fingerprint: dict | None = None  # `stream_fingerprint`, computed once

    @property
    def default_template(self) -> str:
        return default_prompt_template(self.embedded)

    def verl_prompt_notes(self, template: str | None, chat: bool, *, eval_cli: bool = False,
                          chat_template: bool = True) -> list[str]:
        """What prompting verl's rows with `template` (None: the default) and `chat` sends unlike verl does, one
        line each naming the options that change it (train's keys, or `kv4rl eval`'s where `eval_cli`): verl sends a
        row's user message alone, in the chat template (where the tokenizer has one: `chat_template`)."""
        keys = [key for key, layout in self.layouts.items() if layout == "verl"]
        if not keys:
            return []
        named = "--data" if eval_cli else " and ".join(keys)
        holds = "holds" if eval_cli or len(keys) == 1 else "hold"
        template_option, as_verl, chat_option = (
            ("--template", "--template '{problem}'", "--chat") if eval_cli else
            ("data.prompt_template", "\"data.prompt_template='{problem}'\" (quoted so for the shell)",
             "data.chat_template=true"))
        lines = []
        if template is None:
            lines.append(f"{named} {holds} verl's prompts, their instruction included; the default {template_option} "
                         f"adds kv4rl's boxed-answer instruction after each: {as_verl} sends them as verl does")
        if not chat and chat_template:
            lines.append(f"{named} {holds} verl's prompts, which verl sends in the tokenizer's chat template: "
                         f"{chat_option} does the same")
        return lines

    @property
    def default_reward(self) -> str:
        return "exact" if self.embedded else "math_verify"

    def problem_at(self, index: int) -> Problem:
        """The `index`-th problem of the training stream (a pure function of seed and index)."""
        if self.task is not None:
            chunk, pos = divmod(index, _CHUNK)
            return self._task_chunk(chunk)[pos]
        assert self.train is not None
        epoch, pos = divmod(index, len(self.train))
        return self.train[self._epoch_order(epoch)[pos]]

    def stream_fingerprint(self) -> dict:
        """What the training stream is a function of: seed, shuffle and the problems (count, and a hash of
        each one's id, text and answer in order), or the task when it draws fresh problems. A checkpoint
        keeps it; a resume whose stream differs would map the run's position to other problems, repeating
        some and skipping others within the epoch."""
        if self._fingerprint is not None:
            return self._fingerprint
        if self.task is not None:
            spec = {"seed": self.seed, "task": type(self.task).__name__}
            rows = None
        else:
            assert self.train is not None
            rows = len(self.train)
            spec = {"seed": self.seed, "shuffle": self.shuffle, "problems": self.train}
            spec.update(self._row_limit())  # which rows stay (none: older checkpoints' digests stay valid)
        digest = _spec_sha256(spec)
        self._fingerprint = {"rows": rows, "seed": self.seed, "shuffle": self.shuffle, "sha256": digest}
        self._fingerprint.update(self._row_limit())
        return self._fingerprint

    def _row_limit(self) -> dict:
        """What decides which rows of the training file stay: nothing without a limit or a training file."""
        if self.max_prompt_tokens is None or self.train_embedded:
            return {}
        return {"max_prompt_tokens": self.max_prompt_tokens, "prompt_format": self.prompt_format}

    def drop_long_prompts(self, count_tokens: Callable[[list[Problem]], list[int]]) -> list[str]:
        """Drop the files' rows whose prompt is more than `max_prompt_tokens` tokens long (`count_tokens`: each of
        a list's prompt lengths); one line per file that lost rows. The fingerprint stays the whole file's with the
        limit, so every rank agrees without a tokenizer. Refuses a file that would lose every row. Dropping twice
        drops nothing."""
        if self.max_prompt_tokens is None or self._prompts_limited:  # the loop's pass, then the engine build's
            return []
        self.stream_fingerprint()
        said = []
        for name, rows in (("data.train", None if self.train_embedded else self.train), ("data.eval", self.eval_file)):
            if not rows:
                continue
            lengths = count_tokens(rows)
            kept = [p for p, n in zip(rows, lengths) if n <= self.max_prompt_tokens]
            if not kept:
                raise ValueError(f"data.max_prompt_tokens={self.max_prompt_tokens} drops every row of {name} "
                                 f"({len(rows)} rows; its shortest prompt is {min(lengths)} tokens)")
            if len(kept) < len(rows):
                rows[:] = kept  # in place: the train list, or the eval file's
                said.append(f"{name}: dropped {len(lengths) - len(kept)} of {len(lengths)} rows whose prompt is longer "
                            f"than data.max_prompt_tokens={self.max_prompt_tokens} (longest {max(lengths)} tokens)")
        self._order = (-1, [])
        self._prompts_limited = True
        return said

    def batch(self, iteration: int, n: int) -> list[Problem]:
        return [self.problem_at(iteration * n + j) for j in range(n)]

    def _task_chunk(self, chunk: int) -> list[Problem]:
        if self._chunk[0] != chunk:
            self._chunk = (chunk, self.task.problems(_CHUNK, seed=self.seed * 1_000_003 + chunk))
        return self._chunk[1]

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(len(self.train)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def eval_problems(self, n: int | None) -> list[Problem]:
        """The first `n` evaluation problems (None: every row of the eval file, or of the training file)."""
        if self.eval_file is not None:
            return self.eval_file[:n]
        if self.train_embedded:
            seen = {p.problem for p in self.train or []}
            fresh = (p for p in self.embedded_task.problems(n + len(seen), seed=EVAL_SEED_OFFSET + self.seed)
                     if p.problem not in seen)
            return [p for _, p in zip(range(n), fresh)]
        assert self.train is not None
        return self.train[:n]


def _spec_sha256(spec: dict) -> str:
    """sha256 of `json.dumps(spec, sort_keys=True)` with `spec["problems"]` (if any) written as `[[id, problem,
    answer], ...]`, fed to the hash row by row: the same digest checkpoints store, without the one string of the
    whole file (1.5 GB more peak memory at 500k rows)."""
    digest = hashlib.sha256()
    keys = sorted(spec)
    digest.update(b"{")
    for n, key in enumerate(keys):
        digest.update(f"{', ' if n else ''}{json.dumps(key)}: ".encode())
        if key != "problems":
            digest.update(json.dumps(spec[key], sort_keys=True).encode())
            continue
        digest.update(b"[")
        for i, p in enumerate(spec[key]):
            digest.update(((", " if i else "") + json.dumps([p.id, p.problem, p.answer])).encode())
        digest.update(b"]")
    digest.update(b"}")
    return digest.hexdigest()


def _distinct(task: EmbeddedTask, n: int, seed: int) -> list[Problem]:
    """`n` problems with distinct expressions, deterministic in `seed`."""
    out: dict[str, Problem] = {}
    draw = 0
    while len(out) < n:
        for p in task.problems(n, seed=seed * 1_000_003 + 999_983 + draw):
            out.setdefault(p.problem, p)
        draw += 1
        if draw > 100:
            raise ValueError(f"data.pool_size={n} exceeds the number of distinct problems of the task")
    return list(out.values())[:n]
