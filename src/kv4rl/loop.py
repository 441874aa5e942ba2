"""The RL loop: rollout -> reward -> advantages -> update -> engine weight refresh.

This is the only module that holds both the engine and the learner. One iteration takes a learner
batch of `quota_groups` prompt groups x `group_size` responses from the rollout pipeline (sync or
partial collection, with the configured staleness), scores them, computes GRPO advantages, runs the
learner's update(s) and, when the refresh schedule says so, pushes the new weights into the engine
as version `iteration + 1`. Every phase is timed; metrics go to `runs/<name>/metrics.jsonl` and the
engine's per-step trace to `runs/<name>/rollout_trace.jsonl`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from kv4rl.algo.advantages import compute_advantages
from kv4rl.config import RunConfig, save_config
from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.source import ProblemSource
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine, resolve_device
from kv4rl.eval.runner import evaluate
from kv4rl.models.hf_weights import check_model_folder
from kv4rl.rewards import get_reward
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.pipeline import RolloutPipeline
from kv4rl.telemetry.metrics import JsonlWriter
from kv4rl.telemetry.progress import TrainProgress
from kv4rl.telemetry.sinks import MetricsSink
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from kv4rl.trainer.learner import Learner

log = logging.getLogger(__name__)


def resolve_model_dir(cfg: RunConfig, progress: bool = True) -> Path:
    if cfg.model.path is None:
        from kv4rl.models.tiny import tiny_model_dir

        return tiny_model_dir(progress=progress)
    return Path(cfg.model.path)


@dataclass
class Setup:
    cfg: RunConfig
    device: torch.device
    source: ProblemSource
    formatter: PromptFormatter
    reward_fn: object
    engine: Engine
    learner: Learner
    pipeline: RolloutPipeline
    start_iteration: int


def _max_model_len(cfg: RunConfig, source: ProblemSource, formatter: PromptFormatter, model_max: int) -> int:
    """Longest prompt of the data (embedded task: a sample, with headroom) plus the response limit."""
    probe = (source.train or source.batch(0, 64)) + source.eval_problems(cfg.data.eval_size)
    longest = max(len(formatter.ids(p)) for p in probe)
    headroom = 2 * longest if source.embedded else longest
    return min(model_max, headroom + cfg.rollout.max_new_tokens + 1)


def build(cfg: RunConfig, resume: bool, show_progress: bool) -> Setup:
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    source = ProblemSource(cfg.data.train, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size)
    base_dir = resolve_model_dir(cfg, progress=show_progress)
    model_max = check_model_folder(base_dir).max_position_embeddings
    start, policy_dir, state = 0, base_dir, None
    if resume:
        ckpt = latest_checkpoint(cfg.run_dir)
        if ckpt is not None:
            state = load_trainer_state(ckpt)
            start, policy_dir = state["iteration"], ckpt
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    formatter = PromptFormatter(tokenizer, cfg.data.prompt_template or source.default_template,
                                cfg.data.chat_template)
    reward_name = source.default_reward if cfg.reward.name == "auto" else cfg.reward.name
    reward_fn = get_reward(reward_name, timeout_s=cfg.reward.timeout_s) if reward_name == "math_verify" \
        else get_reward(reward_name)
    engine_cfg = EngineConfig(**{f: getattr(cfg.engine, f) for f in EngineConfig.__slots__})
    if engine_cfg.max_model_len is None:
        engine_cfg.max_model_len = _max_model_len(cfg, source, formatter, model_max)
    engine = Engine(policy_dir, engine_cfg, max_num_seqs=cfg.rollout.max_slots, device=device,
                    dtype=cfg.model.dtype, seed=cfg.seed, tokenizer=tokenizer)
    engine.version = start
    if show_progress:
        from rich.console import Console

        Console(stderr=True).print(engine.summary, highlight=False)
    t = cfg.trainer
    learner = Learner(policy_dir, base_dir, algo=cfg.algo, lr=t.lr, weight_decay=t.weight_decay, betas=t.betas,
                      grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size,
                      updates_per_batch=t.updates_per_batch, temperature=cfg.rollout.temperature,
                      device=device, grad_checkpointing=t.grad_checkpointing)
    collector = Collector(engine, source, formatter, cfg.rollout, cfg.seed)
    pipeline = RolloutPipeline(collector, cfg.staleness)
    if state is not None:
        learner.optimizer.load_state_dict(state["optimizer"])
        if state.get("engine_weights") is not None:  # the engine was behind the learner (refresh_every)
            engine.model.load_state_dict(state["engine_weights"])  # its own names: FP8 codes stay exact
        engine.version = state["engine_version"]
        pipeline.load_state_dict(state["pipeline"])
    log.info("device %s, model %s, start iteration %d", device, base_dir, start)
    return Setup(cfg, device, source, formatter, reward_fn, engine, learner, pipeline, start)


def run_iteration(s: Setup, it: int) -> tuple[dict, list[dict]]:
    """One learner update; returns its metrics row and the engine trace of its collection."""
    cfg, r = s.cfg, s.cfg.rollout
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    groups = s.pipeline.next_batch()
    trace, s.pipeline.collector.trace = s.pipeline.collector.trace, []
    times["time_rollout"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    completions = [c for g in groups for c in g.completions]
    prompts = [g.prompt_ids for g in groups for _ in g.completions]
    texts = [s.formatter.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    answers = [g.problem.answer for g in groups for _ in g.completions]
    reward = s.reward_fn(texts, answers)
    rewards = torch.tensor(reward.scores, dtype=torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed * 7_654_321 + it)
    advantages, adv_metrics = compute_advantages(rewards, r.group_size, cfg.advantage, generator=gen)
    times["time_reward"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    pad_id = s.formatter.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else 0
    batch = build_batch(prompts, [c.token_ids for c in completions], [c.logprobs for c in completions],
                        [c.versions for c in completions], advantages.tolist(), pad_id)
    learn = s.learner.step(batch, lr=learning_rate(cfg.trainer, it))
    times["time_update"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    refreshed = s.pipeline.refresh_due(it)
    if refreshed:
        s.engine.load_weights(s.learner.state_dict(), version=it + 1)
    s.pipeline.after_update(it, refreshed)
    times["time_sync"] = time.perf_counter() - t3
    times["time_total"] = time.perf_counter() - t0

    num_gen = sum(len(c.token_ids) for c in completions)
    row = {
        "iteration": it,
        "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_len_mean": num_gen / len(completions),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "tokens_per_s": num_gen / max(times["time_rollout"], 1e-9),
        **staleness_stats(it, completions),
        **collection_stats(trace, r.max_slots),
        "preemptions": s.engine.num_preemptions,
        "dropped_stale": s.pipeline.collector.num_dropped,
        "groups": [g.index for g in groups],
        **{f"reward_{k}": float(v) for k, v in reward.stats.items()},
        **adv_metrics,
        **learn,
        **times,
    }
    return row, [dict(t, iteration=it) for t in trace]


def learning_rate(t, iteration: int) -> float:
    """Linear warm-up over `warmup_iters`, then constant (a pure function of the iteration)."""
    if t.warmup_iters and iteration < t.warmup_iters:
        return t.lr * (iteration + 1) / t.warmup_iters
    return t.lr


def staleness_stats(update: int, completions) -> dict:
    """Per-token staleness (update - version that sampled it): mean, max and histogram."""
    ages = [update - v for c in completions for v in c.versions]
    hist: dict[str, int] = {}
    for a in ages:
        hist[str(a)] = hist.get(str(a), 0) + 1
    return {"staleness_mean": sum(ages) / max(len(ages), 1), "staleness_max": max(ages, default=0),
            "staleness_hist": hist}


def collection_stats(trace: list[dict], max_slots: int) -> dict:
    if not trace:
        return {"decode_steps": 0, "slot_util": 0.0}
    return {"decode_steps": len(trace),
            "slot_util": sum(t["batch_size"] for t in trace) / (len(trace) * max_slots)}


def run_eval(s: Setup, it: int) -> dict:
    cfg = s.cfg
    problems = s.source.eval_problems(cfg.data.eval_size)
    res = evaluate(s.engine, s.formatter, problems, s.reward_fn, k=cfg.eval.k, temperature=cfg.eval.temperature,
                   max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed + 1_000 + it)
    return {f"eval/{k}": v for k, v in res.items()}


def train(cfg: RunConfig, resume: bool = False, show_progress: bool = True) -> dict:
    """Run (or continue) training; returns a summary of the run."""
    sink = MetricsSink(cfg)  # checks the optional viewers before the run folder is touched
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    s = build(cfg, resume, show_progress)
    resume_from = s.start_iteration if resume else None
    writer = JsonlWriter(run_dir / "metrics.jsonl", resume_from=resume_from)
    tracer = JsonlWriter(run_dir / "rollout_trace.jsonl", resume_from=resume_from)
    rows: list[dict] = []
    t_start = time.perf_counter()
    try:
        with TrainProgress(cfg.trainer.iterations, s.start_iteration, enabled=show_progress) as bar:
            for it in range(s.start_iteration, cfg.trainer.iterations):
                row, trace = run_iteration(s, it)
                tracer.write_many(trace)
                if cfg.eval.every and ((it + 1) % cfg.eval.every == 0 or it + 1 == cfg.trainer.iterations):
                    row.update(run_eval(s, it))
                writer.write(row)
                sink.log(row)
                rows.append(row)
                bar.update(row)
                done = it + 1
                if done % cfg.checkpoint.save_every == 0 or done == cfg.trainer.iterations:
                    save_checkpoint(run_dir, done, s.learner.model, s.formatter.tokenizer, s.learner.optimizer,
                                    resume_state(s, done), cfg.checkpoint.keep_last)
    finally:
        writer.close()
        tracer.close()
        sink.close()
        close = getattr(s.reward_fn, "close", None)
        if close is not None:
            close()
    return summarize_run(rows, time.perf_counter() - t_start, run_dir)


def resume_state(s: Setup, done: int) -> dict:
    """What a checkpoint needs beyond the learner: the engine's version (and weights if it lags the
    learner) and every in-flight rollout, so a resumed run hands the learner the same batches."""
    behind = s.engine.version != done
    return {
        "engine_version": s.engine.version,
        "engine_weights": {k: v.detach().cpu().clone() for k, v in s.engine.model.state_dict().items()}
        if behind else None,
        "pipeline": s.pipeline.state_dict(),
    }


def summarize_run(rows: list[dict], seconds: float, run_dir: Path) -> dict:
    if not rows:
        return {"iterations": 0, "seconds": seconds, "run_dir": str(run_dir)}
    head, tail = rows[:5], rows[-5:]
    acc = lambda rs: sum(r["accuracy"] for r in rs) / len(rs)
    return {
        "iterations": len(rows),
        "seconds": seconds,
        "accuracy_first5": acc(head),
        "accuracy_last5": acc(tail),
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        "run_dir": str(run_dir),
    }
