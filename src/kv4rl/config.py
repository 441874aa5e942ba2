"""The run config: one typed tree, loaded from YAML plus dotted overrides, validated across fields.

Each component owns its section (`engine`, `algo`, `advantage` live beside their code); this
module composes them and adds the sections the training loop owns. `load_config` is the single
entry point used by the CLI and by `--resume` (which reloads the run folder's saved config).
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from kv4rl.algo.config import AdvantageConfig, AlgoConfig
from kv4rl.algo.registry import get_loss, import_plugins
from kv4rl.config_loader import ConfigError, apply_overrides, from_dict, merge, read_yaml, to_dict
from kv4rl.config_warnings import log_unread_settings
from kv4rl.data.prompts import check_template
from kv4rl.data.source import DEFAULT_POOL_SIZE
from kv4rl.durability import sync_path
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.sequence import temperature_problem
from kv4rl.paths import text_problem
from kv4rl.reward_config import RewardConfig
from kv4rl.rollout.config import RolloutConfig, StalenessConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "save_config"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """`path: null` uses the embedded tiny model (built and cached on first use), or with `testbed` set
    (e.g. `longmul-gpu`, see `kv4rl build-model`) that testbed's model, built and cached likewise; with
    `data.train: null` a testbed model (by name or by path) trains on its own task."""

    path: str | None = None
    testbed: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training/eval problems. `train: null` uses the embedded arithmetic task (a pool of
    `pool_size` distinct problems; evaluation problems are outside the pool).

    `prompt_template` formats each problem (`{problem}` is replaced); null picks the task's own
    template for the embedded task and a boxed-answer instruction for a dataset file.
    """

    train: str | list[str] | None = None  # a file, or a list of files read one after another (verl's train_files)
    eval: str | list[str] | None = None
    pool_size: int = DEFAULT_POOL_SIZE  # embedded task only: distinct training problems (0 = fresh ones forever)
    prompt_template: str | None = None
    chat_template: bool = False
    eval_size: int | None = 256  # null: every row of data.eval (of data.train without one), as verl validates
    shuffle: bool = True
    # drop the data.train / data.eval rows whose formatted prompt is longer (verl's max_prompt_length with
    # filter_overlong_prompts); null: every row, refused at start only where one fills the context
    max_prompt_tokens: int | None = None

    def prompt_limit(self) -> dict:
        """`ProblemSource`'s `max_prompt_tokens` and the prompt format its lengths are measured in (which rows a
        resume keeps depends on both)."""
        return {"max_prompt_tokens": self.max_prompt_tokens, "prompt_format": [self.prompt_template, self.chat_template]}


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    iterations: int = 100
    lr: float = 1e-4
    warmup_iters: int = 5  # linear learning-rate warm-up over the first iterations
    # after the warm-up: constant, or linear / cosine down to lr x min_lr_ratio at trainer.iterations (verl's
    # and TRL's lr_scheduler_type / min_lr_ratio; transformers' schedules, stepped per iteration)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    updates_per_batch: int = 1
    epochs_per_batch: int = 1  # passes over each learner batch (verl's ppo_epochs), each updates_per_batch steps
    grad_checkpointing: bool = False
    fsdp: bool = True  # FSDP2-wrapped policy (world size 1 unless launched by torchrun)
    offload: bool = False  # FSDP2 CPUOffloadPolicy: parameters, gradients and AdamW state on the CPU (CUDA only)
    # AdamW's two moments in pinned CPU memory, streamed through the GPU each step; parameters and
    # gradients stay on the GPU (trainer/offloaded_adamw.py; CUDA only, not with trainer.offload)
    offload_optimizer: bool = False
    max_tokens_per_micro_batch: int | None = None  # pack rows without padding up to this many tokens; null: padded
    attention: str = "auto"  # auto (flex on CUDA when packing, else sdpa), sdpa or flex (CUDA only)
    # RMSNorms and SwiGLU through torch.compile'd functions (trainer/fused_elementwise.py); null: on for CUDA
    fuse_elementwise: bool | None = None
    # each decoder layer as one torch.compile region (trainer/compiled_layers.py): fuses RoPE, residuals,
    # casts too; null: on for CUDA (1.19x per 1.7B learner step on an H200), off on the CPU
    compile_layers: bool | None = None
    # per-token log-probs, entropy and their gradient in two Triton passes over the logits
    # (kernels/logprob_head.py) instead of chunked torch ops; null: on for CUDA (1.24x per compiled
    # 1.7B learner step on an H200); true needs CUDA
    fused_logprobs: bool | None = None
    ref_kl_every: int = 1  # reference forward for the logged kl_ref every N iterations (0: only for kl_ref_coef > 0)
    # responses cut at rollout.max_new_tokens train no token (TRL's mask_truncated_completions, DAPO's overlong
    # filtering): they count in their group's advantages, then in no loss and no loss denominator
    mask_truncated: bool = False
    # responses whose advantage is exactly 0 (a group of equal scores) train no token and leave the loss
    # denominators (prime-rl's filter_zero_advantages); per-token advantages (reinforce_plus_plus with a KL reward)
    # are left as they are
    mask_zero_advantage: bool = False

    def learning_rate(self, iteration: int) -> float:
        """Linear warm-up over `warmup_iters`, then constant, or a straight line or a half cosine from `lr`
        (at the first iteration after the warm-up) towards `lr * min_lr_ratio` (reached at `iterations`): a
        pure function of the iteration, so a resumed run continues the same curve."""
        if self.warmup_iters and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (iteration - self.warmup_iters) / max(1, self.iterations - self.warmup_iters))
        left = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * left)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    save_every: int = 20
    keep_last: int | None = 2  # null: every checkpoint stays (verl's max_actor_ckpt_to_keep: null)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Periodic evaluation of the policy during training (`every: 0` turns it off); `before_training` also
    evaluates the starting model once (verl's val_before_train), logged as `eval_start/*` in the first row."""

    every: int = 0
    k: int = 1
    temperature: float = 1.0
    before_training: bool = False


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Live viewers besides metrics.jsonl (see `telemetry.sinks`). `tensorboard: auto` writes event
    files into the run folder when the package is installed; `true` requires it. W&B only when asked;
    its run name defaults to the run's name and its group to that name without a `-s<seed>` suffix."""

    tensorboard: Literal["auto"] | bool = "auto"
    wandb: bool = False
    wandb_project: str = "kv4rl"
    wandb_name: str | None = None
    wandb_group: str | None = None


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """Diagnostics beyond the per-iteration metrics. `attribution_every: N` splits the learner-vs-engine
    log-ratio of `attribution_samples` responses of the batch by source (staleness, KV cache, FP8
    weights, kernels...) every N iterations and logs `mismatch/<source>_*` (0: off). It re-scores
    those responses through the engine's reference path and keeps CPU copies of the learner's weights
    for the versions still within the staleness horizon (docs/method.md, "Mismatch attribution")."""

    attribution_every: int = 0
    attribution_samples: int = 4


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "tiny-arith"
    out_dir: str = "runs"
    seed: int = 0
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def validate(self) -> RunConfig:
        """Cross-field checks; each error names the key. Every section's first problem and every failing check below
        are raised together (one ConfigError, a line each), so a config is fixed in one pass."""
        problems: list[str] = []
        for section in (self.engine, self.rollout, self.staleness, self.algo, self.advantage):
            try:
                section.validate()
            except ConfigError as exc:
                problems += exc.problems
            except ValueError as exc:
                problems.append(str(exc))
        moves_zero = self.advantage.zero_advantage_mover()
        checks = [
            (self.trainer.iterations >= 1, "trainer.iterations must be >= 1"),
            (self.trainer.lr > 0, "trainer.lr must be > 0"),
            (self.trainer.warmup_iters >= 0, "trainer.warmup_iters must be >= 0"),
            (0 <= self.trainer.min_lr_ratio <= 1,
             f"trainer.min_lr_ratio must be in [0, 1] (the decaying schedules' last rate as a share of trainer.lr), "
             f"got {self.trainer.min_lr_ratio}"),
            (self.trainer.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1"),
            (self.trainer.updates_per_batch >= 1, "trainer.updates_per_batch must be >= 1"),
            (self.trainer.epochs_per_batch >= 1, "trainer.epochs_per_batch must be >= 1"),
            (self.trainer.updates_per_batch <= self.rollout.quota_groups * self.rollout.group_size,
             f"trainer.updates_per_batch={self.trainer.updates_per_batch} optimizer steps need at least as many "
             f"responses in the learner batch (rollout.quota_groups x rollout.group_size = "
             f"{self.rollout.quota_groups * self.rollout.group_size})"),
            (self.trainer.grad_clip > 0, "trainer.grad_clip must be > 0"),
            (self.trainer.weight_decay >= 0, f"trainer.weight_decay must be >= 0, got {self.trainer.weight_decay}"),
            (self.trainer.lr * self.trainer.weight_decay < 1,
             f"trainer.lr x trainer.weight_decay must be < 1, got {self.trainer.lr:g} x {self.trainer.weight_decay:g}: "
             f"AdamW scales every weight by 1 - lr x weight_decay at each step, so the first step at the full "
             f"rate would zero or flip them all"),
            (all(0 <= b < 1 for b in self.trainer.betas),
             f"trainer.betas must each be in [0, 1) (AdamW's moment decays), got {list(self.trainer.betas)}"),
            (self.trainer.max_tokens_per_micro_batch is None or self.trainer.max_tokens_per_micro_batch >= 1,
             "trainer.max_tokens_per_micro_batch must be >= 1 (or null: padded micro-batches)"),
            (self.trainer.attention in ("auto", "sdpa", "flex"),
             f"trainer.attention must be auto, sdpa or flex, got '{self.trainer.attention}'"),
            (self.trainer.ref_kl_every >= 0, "trainer.ref_kl_every must be >= 0 (0: only when algo.kl_ref_coef > 0)"),
            (not self.advantage.kl_reward_coef > 0 or self.trainer.ref_kl_every > 0 or self.algo.kl_ref_coef > 0,
             "advantage.kl_reward_coef reads the reference model's log-probs every iteration, which "
             "trainer.ref_kl_every=0 (with algo.kl_ref_coef=0) leaves unloaded: set trainer.ref_kl_every=1"),
            (not (self.advantage.kl_reward_coef > 0 and self.advantage.estimator == "reinforce_plus_plus"
                  and self.algo.loss == "ppo_clip" and self.algo.off_policy_mask is not None),
             "algo.off_policy_mask drops a response of negative advantage; with advantage.estimator="
             "reinforce_plus_plus and advantage.kl_reward_coef > 0 each token has its own advantage (its return), "
             "so a response has no one sign: set algo.off_policy_mask=null, or use reinforce_plus_plus_baseline"),
            (self.advantage.kl_reward_control != "adaptive"
             or self.rollout.quota_groups * self.rollout.group_size < 5 * self.advantage.kl_reward_horizon,
             f"advantage.kl_reward_horizon={self.advantage.kl_reward_horizon:g} must exceed a fifth of the batch's "
             f"{self.rollout.quota_groups * self.rollout.group_size} responses: a KL below target multiplies β by "
             "1 - 0.2 x responses / horizon, which would turn the penalty into a bonus"),
            (not (self.trainer.mask_zero_advantage and moves_zero),
             f"trainer.mask_zero_advantage masks the responses whose advantage is exactly 0 (a flat group's), but "
             f"{moves_zero} moves that 0 away, so no response would be masked; set one of them off"),
            (self.advantage.estimator != "optimal_token_baseline" or self.rollout.placement == "colocated",
             "advantage.estimator=optimal_token_baseline reads the policy's Σπ² of every token, which the learner "
             "computes before the advantages; with rollout.placement=split the head computes them alone: use "
             "rollout.placement=colocated"),
            (self.advantage.estimator != "optimal_token_baseline" or self.algo.loss != "ppo_clip"
             or self.algo.behavior_is == "none",
             "advantage.estimator=optimal_token_baseline with algo.behavior_is: verl then weighs each path's variance "
             "by the squared IS weights, which is not built here; set algo.behavior_is=none"),
            (self.trainer.fsdp or not self.trainer.offload, "trainer.offload=true needs trainer.fsdp=true"),
            (self.device != "cpu" or not self.trainer.offload,
             "trainer.offload=true needs a CUDA device (on the CPU everything already is in CPU memory)"),
            (self.device != "cpu" or not self.trainer.offload_optimizer,
             "trainer.offload_optimizer=true needs a CUDA device (it streams AdamW's moments between pinned CPU "
             "memory and the GPU; on the CPU they already are in CPU memory)"),
            (not (self.trainer.offload and self.trainer.offload_optimizer),
             "trainer.offload_optimizer=true cannot be combined with trainer.offload=true, which already keeps "
             "AdamW's state (with the parameters and gradients) in CPU memory; set one of them"),
            (self.device != "cpu" or self.trainer.fused_logprobs is not True,
             "trainer.fused_logprobs=true needs a CUDA device (its Triton kernels run there)"),
            (self.device != "cpu" or self.trainer.attention != "flex",
             "trainer.attention=flex needs a CUDA device (FlexAttention has no backward pass on the CPU)"),
            (self.checkpoint.save_every >= 1, "checkpoint.save_every must be >= 1"),
            (self.checkpoint.keep_last is None or self.checkpoint.keep_last >= 1,
             "checkpoint.keep_last must be >= 1 (or null: keep every checkpoint)"),
            (self.eval.every >= 0, "eval.every must be >= 0 (0: no evaluation, verl's test_freq -1)"),
            (self.eval.k >= 1, "eval.k must be >= 1"),
            (temperature_problem("eval.temperature", self.eval.temperature) is None,
             temperature_problem("eval.temperature", self.eval.temperature)),
            (self.telemetry.attribution_every >= 0, "telemetry.attribution_every must be >= 0 (0: off)"),
            (self.telemetry.attribution_samples >= 1, "telemetry.attribution_samples must be >= 1"),
            (self.data.eval_size is None or self.data.eval_size >= 1,
             "data.eval_size must be >= 1 (or null: every row of data.eval)"),
            (self.data.eval_size is not None or self.data.train is not None or self.data.eval is not None,
             "data.eval_size=null evaluates every row of a data file, and this run has none (the embedded task "
             "draws its problems without end): give a number"),
            (self.data.pool_size >= 0, "data.pool_size must be >= 0"),
            (self.data.max_prompt_tokens is None or self.data.max_prompt_tokens >= 1,
             f"data.max_prompt_tokens must be >= 1 (or null: no limit), got {self.data.max_prompt_tokens}"),
            (self.data.max_prompt_tokens is None or self.data.train is not None or self.data.eval is not None,
             "data.max_prompt_tokens drops rows of the data.train / data.eval files, and this run has neither "
             "(the embedded task's prompts are a few tokens); leave it null"),
            (self.reward.timeout_s > 0, "reward.timeout_s must be > 0"),
            (re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
             f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}"),
            *[(problem is None, problem) for problem in
              # what the run writes (its folder) and its prompt text; files it only reads may be named in any bytes
              (text_problem(key, str(value), path=key != "data.prompt_template") for key, value in (
                  ("name", self.name), ("out_dir", self.out_dir), ("data.prompt_template", self.data.prompt_template))
               if value is not None)],
            (bool(self.name) and "/" not in self.name and self.name not in (".", "..")
             and not any(unicodedata.category(c) == "Cc" for c in self.name),
             f"name={self.name!r}: must be a folder name (not empty, '.' or '..', no '/' or control characters)"),
            (bool(str(self.out_dir).strip()),
             "out_dir is empty; give the folder that holds the run folders (default: runs)"),
            (-(2**63) <= self.seed < 2**64, f"seed must be in [-2**63, 2**64) (torch's seed range), got {self.seed}"),
            *[(value != "" and value != [], f"{key} is empty; leave it out (null) or give a path")
              for key, value in (("model.path", self.model.path), ("data.train", self.data.train),
                                 ("data.eval", self.data.eval))],
            *[(entry != "", f"{key}[{i}] is empty; give a path") for key, value in
              (("data.train", self.data.train), ("data.eval", self.data.eval)) if isinstance(value, list)
              for i, entry in enumerate(value)],
        ]
        problems += [message for ok, message in checks if not ok]
        if problems:
            raise ConfigError.of(problems)
        if self.advantage.kl_reward_coef > 0 and "ref_logprobs" not in get_loss(self.algo.loss).inputs(self.algo):
            raise ConfigError(f"advantage.kl_reward_coef reads the reference model, which the learner loads only for "
                              f"a loss that reads reference log-probs; algo.loss={self.algo.loss} does not (declare "
                              "ref_logprobs in its inputs)")
        if self.model.testbed is not None:
            from kv4rl.models.testbed import check_testbed

            if self.model.path is not None:
                raise ConfigError("model.path and model.testbed both name the model; give one of them")
            try:
                check_testbed(self.model.testbed)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.engine.sleep_between_rollouts and self.rollout.mode == "partial" and self.rollout.carry == "keep_kv":
            raise ConfigError(
                "engine.sleep_between_rollouts frees the KV cache during every update, so the responses that "
                "partial rollout carries over are recomputed; set rollout.carry=recompute with it "
                "(rollout.carry=keep_kv would need their KV kept)")
        self.reward.validate(self.rollout.max_new_tokens, self.advantage.estimator)
        if self.data.prompt_template is not None:
            try:
                check_template(self.data.prompt_template, "data.prompt_template")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        log_unread_settings(self)
        return self


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, validate: bool = True) -> RunConfig:
    """Defaults <- `base` mapping <- YAML file <- dotted overrides; then validate (types are always checked;
    `validate=False` leaves the ranges and combinations to the caller's `RunConfig.validate`)."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = merge(data, read_yaml(path))
    data = apply_overrides(data, list(overrides or []))
    _import_loss_plugins(data)
    cfg = _resolve_paths(from_dict(RunConfig, data))
    return cfg.validate() if validate else cfg


def _resolve_paths(cfg: RunConfig) -> RunConfig:
    """`~` in the path keys means the home folder, as in a shell (`model.path=~/x` is one word to the shell,
    which expands only a leading `~`, so it arrived unexpanded). The model and data paths are made
    absolute: config.yaml records the files the run read, so a `--resume` from another folder reads the
    same ones (a relative path would name whatever the new working folder holds)."""
    home = lambda v: os.path.expanduser(v) if isinstance(v, str) and v.startswith("~") else v  # noqa: E731
    one = lambda v: os.path.abspath(home(v)) if isinstance(v, str) and v else v  # noqa: E731
    absolute = lambda v: [one(x) for x in v] if isinstance(v, list) else one(v)  # noqa: E731
    cfg.model.path, cfg.data.train, cfg.data.eval = (absolute(cfg.model.path), absolute(cfg.data.train),
                                                     absolute(cfg.data.eval))
    cfg.out_dir = home(cfg.out_dir)
    return cfg


def _import_loss_plugins(data: dict[str, Any]) -> None:
    """Import `algo.plugins` before the `algo` section is read: their losses own some of its keys."""
    algo = data.get("algo")
    plugins = algo.get("plugins") if isinstance(algo, dict) else None
    if plugins is None:
        return
    if not isinstance(plugins, list) or not all(isinstance(m, str) for m in plugins):
        raise ConfigError(f"algo.plugins: expected a list of module names like [my_losses], got {plugins!r}")
    try:
        import_plugins(plugins)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def save_config(cfg: RunConfig, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        sync_path(tmp)  # on the disk before it replaces the config a resume reads
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or quota: the config a resume reads stays as it was
        raise
    tmp.replace(path)
