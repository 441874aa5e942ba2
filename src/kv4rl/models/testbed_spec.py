"""What shapes one testbed's weights: the spec (task, size, warm-up settings) and the parts of the warm-up
recipe that live in code (AdamW settings, the worked-solution text), which key the build cache together.
Shared by `kv4rl.models.testbed` (specs and cache) and `kv4rl.models.warmup` (the training itself)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kv4rl.data.longmul import LongMulTask
from kv4rl.data.synthetic import PROMPT_TEMPLATE, ArithmeticTask
from kv4rl.data.types import Problem

TASK_TYPES = {"arith": ArithmeticTask, "longmul": LongMulTask}

WARMUP_OPTIMIZER = {"weight_decay": 0.01, "betas": (0.9, 0.95), "grad_clip": 1.0}  # AdamW of the warm-up


def target_text(task, problem: Problem) -> str:
    """The response the warm-up teaches: the task's worked solution (arith: the boxed answer)."""
    if isinstance(task, LongMulTask):
        return task.target(problem)
    from kv4rl.data.synthetic import target_text as boxed

    return boxed(problem.answer)


@dataclass(frozen=True, kw_only=True)
class TestbedSpec:
    """Everything that shapes one testbed's model; its JSON form keys the cache."""

    task: str
    size: str
    task_settings: dict
    model_shape: dict
    steps: int
    batch_size: int
    learning_rate: float
    lr_warmup_steps: int
    eval_problems: int
    # Stop the warm-up once the held-out probability of sampling the exact worked solution (a lower bound
    # on sampled accuracy, `solution_probability`) reaches this, checked every `check_every` steps; None:
    # run all `steps`. Stopping on the measured value keeps the starting accuracy in RL's useful band on
    # any hardware, where a fixed step count would land anywhere from 0 to 100% (the task is learnable).
    target_accuracy: float | None = None
    check_every: int = 25
    seed: int = 0
    eval_seed: int = 10_001  # other draws than training (random.Random(seed)); not disjoint on a small space
    cpu_threads: int | None = 1  # see tiny.BUILD_THREADS; None: leave torch's setting

    @property
    def name(self) -> str:
        return f"{self.task}-{self.size}"

    def make_task(self) -> ArithmeticTask | LongMulTask:
        return TASK_TYPES[self.task](**self.task_settings)

    def recipe(self) -> dict:
        """Everything that shapes the built weights, the cache key (a change rebuilds): the spec, and the
        warm-up's prompt template, worked-solution format (one example) and optimizer settings, which live
        in code (a changed template reused the stale build)."""
        task = self.make_task()
        build = {"prompt_template": PROMPT_TEMPLATE, "optimizer": WARMUP_OPTIMIZER,
                 "solution_example": target_text(task, task.problems(1, seed=0)[0])}
        return json.loads(json.dumps({**{k: v for k, v in asdict(self).items() if k != "cpu_threads"}, **build}))
