"""The rollout side of a run, built before its folder is touched: prompt formatter, reward function,
engine (its context sized from the data) and the collector of this engine's share of the groups.
Shared by the colocated loop (`kv4rl.loop`) and a split run's engine ranks (`kv4rl.split`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kv4rl.config import ConfigError, RunConfig
from kv4rl.data.prompts import PromptFormatter, boxed_request_note, longest_prompt, overrun_warning
from kv4rl.data.source import ProblemSource
from kv4rl.distributed import Ranks
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine
from kv4rl.models.hf_weights import check_model_folder, load_tokenizer
from kv4rl.rewards import RewardResult, WeightedRewards, get_reward, score_responses
from kv4rl.rollout.collector import Collector, GroupResult

log = logging.getLogger(__name__)


def prompt_formatter(cfg: RunConfig, source: ProblemSource, tokenizer) -> PromptFormatter:
    """The run's prompts: `data.prompt_template` (or the data's default), in the chat template if asked."""
    return PromptFormatter(tokenizer, cfg.data.prompt_template or source.default_template, cfg.data.chat_template)


def prompt_warnings(cfg: RunConfig, source: ProblemSource, formatter: PromptFormatter) -> list[str]:
    """What the run's prompts ask for unlike what verl sends or the reward grades, one line each (said at start)."""
    lines = source.verl_prompt_notes(cfg.data.prompt_template, cfg.data.chat_template,
                                     chat_template=bool(getattr(formatter.tokenizer, "chat_template", None)))
    note = None if source.train_embedded else boxed_request_note(source.train, formatter, verifier_name_of(cfg, source))
    rows = len(source.eval_file) if source.eval_file is not None else 0
    cut = cfg.data.eval_size is not None and rows > cfg.data.eval_size
    if (cfg.eval.every or cfg.eval.before_training) and cut:  # verl validates on every row
        lines.append(f"data.eval holds {rows} rows; each evaluation uses its first {cfg.data.eval_size} "
                     f"(data.eval_size), {'the first files of the list, ' if isinstance(cfg.data.eval, list) else ''}"
                     f"where verl's validation uses every row: data.eval_size=null evaluates them all")
    return lines + ([note] if note else [])


def drop_long_prompts(source: ProblemSource, formatter: PromptFormatter, say: bool = True) -> None:
    """`data.max_prompt_tokens`: drop the files' longer rows, saying how many where `say` (one rank of a job; nothing
    on a second call)."""
    try:
        for line in source.drop_long_prompts(formatter.lengths):
            if say:  # shown: the run trains on fewer rows than the file has
                log.warning(line)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def max_model_len(cfg: RunConfig, source: ProblemSource, formatter: PromptFormatter, model_max: int) -> int:
    """`engine.max_model_len` as given, else the longest prompt of the data (embedded task: a sample, with
    headroom) plus the response limit.

    A context beyond the model's positions, or a prompt that fills the context, is refused here, by name,
    before any generation; a response limit that runs past the context is cut to it with one warning line,
    as inference engines do.
    """
    given = cfg.engine.max_model_len
    if given is not None and given > model_max:
        raise ConfigError(f"engine.max_model_len={given} exceeds the model's context of {model_max} positions "
                          f"(max_position_embeddings); give at most {model_max}, or null to size it from the data")
    limit, limit_name = (model_max, "the model's context") if given is None else (given, "engine.max_model_len")
    named = lambda key, paths: f"{key} {', '.join(paths) if isinstance(paths, list) else paths}"  # noqa: E731
    train_name = named("data.train", cfg.data.train) if cfg.data.train else "the embedded task"
    eval_name = named("data.eval", cfg.data.eval) if cfg.data.eval else train_name
    longest = max(longest_prompt(formatter, problems, limit, limit_name, what)
                  for what, problems in ((train_name, source.train or source.batch(0, 64)),
                                         (eval_name, source.eval_problems(cfg.data.eval_size))))
    warning = overrun_warning(longest, cfg.rollout.max_new_tokens,
                              f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}", limit, limit_name)
    if warning:
        log.warning(warning)
    if given is not None:
        return given
    headroom = 2 * longest if source.train_embedded else longest
    return min(model_max, headroom + cfg.rollout.max_new_tokens + 1)


def engine_slots(cfg: RunConfig, device: torch.device, world: int) -> int:
    """The engine's decode slots: `rollout.max_slots`, except that a sync run on the CPU takes only what its
    batch runs at once (this rank's `quota_groups` x `group_size`): there the pool holds every slot at
    `max_model_len` (3.2 GiB for 4 responses of SmolLM2 at 256 slots), and a sync batch never fills more. The
    tokens do not change (requests are seeded one by one); `slot_util` still counts against `max_slots`."""
    r = cfg.rollout
    if device.type == "cpu" and r.mode == "sync":
        per_group = r.group_size + (1 if cfg.advantage.estimator == "remax" else 0)  # ReMax's greedy response
        return max(1, min(r.max_slots, r.quota_groups // max(1, world) * per_group))
    return r.max_slots


def verifier_name_of(cfg: RunConfig, source: ProblemSource) -> str:
    """The run's verifier: `reward.name`, or with `auto` the data's own (exact for the embedded task, math_verify
    for a file)."""
    return source.default_reward if cfg.reward.name == "auto" else cfg.reward.name


def build_reward(cfg: RunConfig, source: ProblemSource):
    """The run's reward: `reward.name` (auto: the source's), or with `reward.extra` / `reward.weights` the weighted
    sum of it and the extras (`WeightedRewards`, its first reward the verifier)."""
    verifier = verifier_name_of(cfg, source)
    names = [verifier, *cfg.reward.extra]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.extra: {verifier!r} is already the verifier (reward.name={cfg.reward.name}"
                          f"{' picks it for this data' if cfg.reward.name == 'auto' else ''}); name it once")
    built = []
    try:
        for name in names:
            built.append(get_reward(name, timeout_s=cfg.reward.timeout_s) if name == "math_verify" else get_reward(name))
    except BaseException:
        for reward in built:
            reward.close()
        raise
    if len(built) == 1 and cfg.reward.weights is None:
        return built[0]
    weights = cfg.reward.weights or [1.0] * len(names)
    return WeightedRewards(list(zip(names, built, weights, strict=True)))


def groups_scorer(cfg: RunConfig, formatter: PromptFormatter, reward_fn) -> Callable[[list[GroupResult]], RewardResult]:
    """The trained scores of every response of `groups`, in order, as the learner gets them."""
    def score(groups: list[GroupResult]) -> RewardResult:
        completions = [c for g in groups for c in g.completions]
        texts = [formatter.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        return score_responses(reward_fn, texts, [g.problem.answer for g in groups for _ in g.completions],
                               [len(c.token_ids) for c in completions], cfg.reward, cfg.rollout.max_new_tokens,
                               problems=[g.problem for g in groups for _ in g.completions],
                               group_sizes=[len(g.completions) for g in groups])
    return score


def baseline_scores(groups: list[GroupResult], score: Callable[[list[GroupResult]], RewardResult]) -> RewardResult:
    """ReMax's baseline of each group: the trained score (the same reward, penalties and rescaling) of its greedy
    response, in one `score` call; its counts (`timeouts`, `no_answer`) are logged as `reward_baseline_<count>`
    (`baseline_stats`), so a baseline that timed out to 0 shows."""
    if any(g.baseline is None for g in groups):
        raise ValueError("advantage.estimator=remax: a group came without its greedy response")
    alone = [GroupResult(g.index, g.problem, g.prompt_ids, [g.baseline]) for g in groups]  # type: ignore[list-item]
    result = score(alone)
    return RewardResult([float(x) for x in result.scores], {k: float(v) for k, v in result.stats.items()})


def baseline_stats(baseline: RewardResult | None) -> dict[str, float]:
    """The greedy responses' reward counts as `baseline_<count>` (logged with the reward's as `reward_...`)."""
    return {} if baseline is None else {f"baseline_{k}": float(v) for k, v in baseline.stats.items()}


def batch_reward(groups: list[GroupResult], score: Callable[[list[GroupResult]], RewardResult]) -> RewardResult:
    """The scores of every response of `groups` in order: a group's own where the collector scored it
    (`rollout.filter_groups`), one `score` call for the rest; the counts (stats) add up."""
    owns = [getattr(g, "reward", None) for g in groups]
    missing = [g for g, own in zip(groups, owns) if own is None]
    fresh = score(missing) if missing else RewardResult([])
    parts, offset = [], 0
    for g, own in zip(groups, owns):
        if own is None:
            own = fresh.rows(offset, offset + len(g.completions))
            offset += len(g.completions)
        parts.append(own)
    joined = RewardResult.joined(parts)  # the collector's own groups' counts, added up
    for key, value in fresh.stats.items():
        joined.stats[key] = joined.stats.get(key, 0.0) + float(value)
    return joined


def build_rollout(cfg: RunConfig, source: ProblemSource, base_dir: Path, policy_dir: Path, device: torch.device,
                  engine_ranks: Ranks, show_progress: bool, update_memory: Callable[[int], int] | None = None,
                  tokenizer=None) -> tuple[PromptFormatter, object, Engine, Collector]:
    """The rollout side of a run: prompt formatter, reward function, engine, and the collector of this
    engine's share (`engine_ranks`) of the prompt groups. `update_memory(max_model_len)`: the device
    bytes a learner on the same device will allocate for its update, left free by an engine that stays
    awake through it (`Learner.update_memory_bytes`). `tokenizer`: `policy_dir`'s, where the caller has
    loaded it already (the loop does, to check it before the learner's build): seconds at 8B."""
    model_max = check_model_folder(base_dir).max_position_embeddings
    if tokenizer is None:
        tokenizer = load_tokenizer(policy_dir)
    formatter = prompt_formatter(cfg, source, tokenizer)
    drop_long_prompts(source, formatter, say=engine_ranks.rank == 0)
    reward_fn = build_reward(cfg, source)
    engine_cfg = EngineConfig(**{f: getattr(cfg.engine, f) for f in EngineConfig.__slots__})
    engine_cfg.max_model_len = max_model_len(cfg, source, formatter, model_max)
    reserve = 0
    if update_memory is not None and not engine_cfg.sleep_between_rollouts:
        reserve = update_memory(engine_cfg.max_model_len)
    engine = Engine(policy_dir, engine_cfg, max_num_seqs=engine_slots(cfg, device, engine_ranks.world), device=device,
                    dtype=cfg.model.dtype, seed=cfg.seed, tokenizer=tokenizer, reserve_bytes=reserve)
    if show_progress:
        from rich.console import Console

        Console(stderr=True).print(engine.summary, highlight=False, soft_wrap=True)  # one line a script can grep
    try:
        collector = Collector(engine, source, formatter, cfg.rollout, cfg.seed, ranks=engine_ranks,
                              score_group=(lambda g, score=groups_scorer(cfg, formatter, reward_fn): score([g]))
                              if cfg.rollout.filter_groups else None,
                              greedy_baseline=cfg.advantage.estimator == "remax")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return formatter, reward_fn, engine, collector
