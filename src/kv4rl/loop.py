"""The RL loop: rollout -> reward -> advantages -> update -> engine weight refresh.

This is the only module that holds both the engine and the learner. One iteration takes a learner
batch of `quota_groups` prompt groups x `group_size` responses from the rollout pipeline (sync or
partial collection, with the configured staleness), scores them, turns them into the learner's batch
(`kv4rl.learner_batch`: a KL in the reward, the advantages), runs the learner's update(s) and, when the
refresh schedule says so, pushes the new weights into the engine
as version `iteration + 1`. With `engine.sleep_between_rollouts` the engine frees its KV pool before
the update and allocates it again after the refresh (`time_sleep_wake` holds both). Every phase is
timed; metrics go to `runs/<name>/metrics.jsonl` and the engine's per-step trace to
`runs/<name>/rollout_trace.jsonl`. The run folder is written only once the
first iteration has succeeded (`kv4rl.run_folder`), and a SIGTERM/SIGINT ends the run after the
current iteration with a checkpoint (`kv4rl.graceful_stop`).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kv4rl.algo.kl_reward import KLRewardCoef
from kv4rl.closing import close_all
from kv4rl.config import ConfigError, RunConfig
from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.datasets import load_problems
from kv4rl.data.source import ProblemSource
from kv4rl.distributed import Ranks, any_rank, barrier, current, gather_objects, merge_rank_rows
from kv4rl.engine.llm import Engine
from kv4rl.engine.placement import resolve_device
from kv4rl.engine.plan import check_kernel_settings, probe_capabilities
from kv4rl.engine.sampler import stream_seed
from kv4rl.eval.data_parallel import evaluate_ranks
from kv4rl.graceful_stop import GracefulStop
from kv4rl.learner_batch import learner_batch
from kv4rl.models.fingerprint import row_fingerprint
from kv4rl.models.hf_weights import check_model_folder, load_tokenizer
from kv4rl.models.tensor_parallel import check_shardable
from kv4rl.rewards import WeightedRewards, reward_metrics, summed_reward_stats, verifier_name
from kv4rl.rollout.build import (baseline_scores, baseline_stats, batch_reward, build_rollout, drop_long_prompts,
                                 groups_scorer, prompt_formatter, prompt_warnings)
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.pipeline import RolloutPipeline
from kv4rl.run_checkpoint import restore_state, save
from kv4rl.run_folder import RunFolder, check_new_run
from kv4rl.run_setup import (
    Restore,
    build_learner,
    check_same_model,
    check_same_stream,
    check_updates_per_rank,
    find_restore,
    finished_summary,
    resolve_model_dir,
    short_response_warning,
    task_of_model,
)
from kv4rl.telemetry.attribution import MismatchAttribution
from kv4rl.telemetry.progress import TrainProgress
from kv4rl.telemetry.run_stats import collection_stats, staleness_stats, stepped, summarize_run
from kv4rl.telemetry.run_watch import run_watch
from kv4rl.telemetry.sinks import MetricsSink
from kv4rl.trainer.checkpoint import check_resume_world
from kv4rl.trainer.host_memory import check_host_memory, count_parameters
from kv4rl.trainer.learner import Learner
from kv4rl.trainer.learner_options import check_learner_options

log = logging.getLogger(__name__)
EVAL_STREAM = 0  # `stream_seed`'s stream of the periodic evaluations (one call per evaluated iteration)

@dataclass
class Setup:
    cfg: RunConfig
    device: torch.device
    source: ProblemSource
    formatter: PromptFormatter
    reward_fn: object
    engine: Engine
    learner: Learner
    collector: Collector
    pipeline: RolloutPipeline
    start_iteration: int
    attribution: MismatchAttribution | None = None
    model_sha256: str | None = None  # the starting model's fingerprint (rank 0 only), in every metrics row
    base_dir: Path | None = None  # the starting model's folder (a testbed's record goes into each checkpoint)
    kl_coef: KLRewardCoef | None = None  # β of a KL in the reward, which may adapt (and is checkpointed)


def build(cfg: RunConfig, restore: Restore | None, show_progress: bool) -> Setup:
    """Everything a run needs, built and checked before its folder is touched."""
    device = resolve_device(cfg.device)
    try:
        check_learner_options(device, fsdp=cfg.trainer.fsdp, offload=cfg.trainer.offload,
                              attention=cfg.trainer.attention, fused_logprobs=cfg.trainer.fused_logprobs,
                              offload_optimizer=cfg.trainer.offload_optimizer)
        check_kernel_settings(cfg.engine, probe_capabilities(device))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    torch.manual_seed(cfg.seed)
    # a training file is read (and checked) before any model is built; without one, the model's task is used
    source = ProblemSource(cfg.data.train, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size,
                           **cfg.data.prompt_limit()) if cfg.data.train is not None else None
    if source is None and cfg.data.eval is not None:  # read again below, with the model's task: a bad file is
        load_problems(cfg.data.eval)                  # named now, not after a missing model's build (~30 s)
    ranks = current()
    if restore is not None:
        check_resume_world(restore.path, restore.state, ranks.world)
    tp = cfg.engine.tensor_parallel
    if tp > 1 and ranks.world == 1:
        raise ConfigError(f"engine.tensor_parallel={tp} needs {tp} processes: start with "
                          f"`torchrun --nproc-per-node {tp} -m kv4rl.cli train ...`")
    if ranks.world % tp:
        raise ConfigError(f"engine.tensor_parallel={tp} does not divide the {ranks.world} ranks torchrun started")
    if cfg.rollout.quota_groups % ranks.world:
        why = ("each engine's groups are shared out among its tensor-parallel ranks for the learner"
               if cfg.engine.tensor_parallel > 1 else "each data-parallel rank collects and learns on an equal share")
        raise ConfigError(f"rollout.quota_groups={cfg.rollout.quota_groups} must split evenly over the {ranks.world} "
                          f"ranks ({why})")
    check_updates_per_rank(cfg, ranks.world)
    engine_ranks = Ranks(ranks.rank // cfg.engine.tensor_parallel, ranks.world // cfg.engine.tensor_parallel)
    if not ranks.main:  # rank 0 builds a missing embedded model or testbed into the cache first
        barrier()
    base_dir = resolve_model_dir(cfg, progress=show_progress)
    if ranks.main:
        barrier()
    if source is None:
        source = ProblemSource(None, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size,
                               task=task_of_model(base_dir), **cfg.data.prompt_limit())
    if ranks.main and (short := short_response_warning(cfg, base_dir)) is not None:
        log.warning(short)
    if restore is not None:
        check_same_stream(restore, source.stream_fingerprint(), cfg.run_dir / "config.yaml")
        check_same_model(restore, base_dir, cfg.run_dir / "metrics.jsonl")
    policy_dir = base_dir if restore is None else restore.path
    model_args = check_model_folder(base_dir)  # a clear error before the learner (built first, below) reads it
    tokenizer = load_tokenizer(policy_dir, model_args.vocab_size if ranks.main else None)  # ... and its tokenizer
    # a file it would empty is refused before the learner's build
    formatter = prompt_formatter(cfg, source, tokenizer)
    drop_long_prompts(source, formatter, say=ranks.main)
    for line in prompt_warnings(cfg, source, formatter) if ranks.main else ():
        log.warning(line)
    if tp > 1:  # the engine would refuse the model's shape only after the learner loaded (minutes at 8B)
        try:
            check_shardable(model_args, tp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.trainer.offload or cfg.trainer.offload_optimizer:  # before the engine loads: minutes at 8B
        try:
            check_host_memory(count_parameters(policy_dir), offload=cfg.trainer.offload,
                              offload_optimizer=cfg.trainer.offload_optimizer, world_size=ranks.world)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # the learner first: an engine's pool sized from device memory then sees its weights, and one that
    # stays awake through the update (no sleep) also leaves room for what the update will allocate
    learner = build_learner(cfg, policy_dir, base_dir, device)
    formatter, reward_fn, engine, collector = build_rollout(cfg, source, base_dir, policy_dir, device, engine_ranks,
                                                            show_progress, update_memory=learner.update_memory_bytes,
                                                            tokenizer=tokenizer)
    if ranks.world > 1 and cfg.telemetry.attribution_every:
        raise ConfigError("telemetry.attribution_every runs in one process for now; set it to 0 under torchrun")
    s = Setup(cfg, device, source, formatter, reward_fn, engine, learner, collector,
              RolloutPipeline(collector, cfg.staleness), 0, MismatchAttribution.from_config(cfg, engine, learner),
              kl_coef=KLRewardCoef.from_config(cfg.advantage))
    if restore is not None:
        restore_state(s, restore.state, restore.path)
    s.base_dir = base_dir
    if ranks.main:  # the config's model, also on resume: a resume onto another build shows in the rows
        s.model_sha256 = row_fingerprint(base_dir)
    log.info("device %s, model %s, start iteration %d, learner attention %s (%s micro-batches), %s", device,
             base_dir, s.start_iteration, learner.attention,
             "packed" if cfg.trainer.max_tokens_per_micro_batch else "padded", learner.options_desc)
    return s


def run_iteration(s: Setup, it: int) -> tuple[dict, list[dict]]:
    """One learner update; returns its metrics row and the engine trace of its collection."""
    cfg, r = s.cfg, s.cfg.rollout
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    groups = s.pipeline.next_batch()
    trace = s.collector.take_trace()
    times["time_rollout"] = time.perf_counter() - t0
    tp = s.engine.tp
    if tp.size > 1:  # the ranks of one tensor-parallel engine share its groups out for the learner
        groups = groups[tp.rank::tp.size]
    sleep = s.engine.config.sleep_between_rollouts
    times["time_sleep_wake"] = 0.0
    if sleep:  # the learner gets the KV pool's memory for its forward passes (a KL in the reward) and update
        t = time.perf_counter()
        s.engine.sleep()
        times["time_sleep_wake"] += time.perf_counter() - t

    t1 = time.perf_counter()
    completions = [c for g in groups for c in g.completions]
    prompts = [g.prompt_ids for g in groups for _ in g.completions]
    scorer = groups_scorer(cfg, s.formatter, s.reward_fn)
    reward = batch_reward(groups, scorer)  # filter_groups scored some
    baseline = baseline_scores(groups, scorer) if cfg.advantage.estimator == "remax" else None
    baselines = None if baseline is None else torch.tensor(baseline.scores, dtype=torch.float64)
    rewards = torch.tensor(reward.scores, dtype=torch.float64)  # float32 rounds 3e7 + 1
    reward_row = reward_metrics(reward, verifier_name(s.reward_fn))
    pad_id = s.formatter.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else 0
    rows = (prompts, [c.token_ids for c in completions], [c.logprobs for c in completions],
            [c.versions for c in completions])
    truncated = [c.finish_reason == "length" for c in completions] if cfg.trainer.mask_truncated else None
    made = learner_batch(cfg, s.learner, rows, rewards, r.group_size, [g.index for g in groups], it, pad_id, truncated,
                         s.kl_coef, baselines)
    batch, given, rewards, adv_metrics = made.batch, made.given, made.rewards, made.metrics
    times["time_reward"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    mismatch = s.attribution.observe(it, batch) if s.attribution is not None else {}
    t2 += mismatch.get("mismatch/time_s", 0.0)  # a diagnostic, not update time
    learn = s.learner.step(batch, lr=cfg.trainer.learning_rate(it), iteration=it, given=given)
    times["time_update"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    refreshed = s.pipeline.refresh_due(it)
    if refreshed:
        s.engine.load_weights(s.learner.full_weights(), version=it + 1)  # streamed: one tensor at a time
    s.pipeline.after_update(it, refreshed)
    times["time_sync"] = time.perf_counter() - t3
    if sleep:  # after the refresh: a re-sized pool sees the learner's memory as it stays between updates
        t = time.perf_counter()
        s.engine.wake()
        times["time_sleep_wake"] += time.perf_counter() - t
    times["time_total"] = time.perf_counter() - t0

    num_gen = sum(len(c.token_ids) for c in completions)
    row = {
        "iteration": it,
        **reward_row,
        "response_len_mean": num_gen / len(completions),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        # None when the engine took no step (the batch was finished earlier): its ~1e6 was the time of a hand-over
        "tokens_per_s": num_gen / max(times["time_rollout"], 1e-9) if stepped(trace) else None,
        **staleness_stats(it, completions),
        **collection_stats(trace, r.max_slots),
        # engine counts, once per engine (its tensor-parallel ranks all see the same)
        "preemptions": s.engine.num_preemptions if tp.rank == 0 else 0,
        "dropped_stale": s.collector.num_dropped if tp.rank == 0 else 0,
        **({"filtered_groups": len(s.collector.take_filtered()) if tp.rank == 0 else 0} if r.filter_groups else {}),
        "groups": [g.index for g in groups],
        **{f"reward_{k}": float(v) for k, v in {**reward.stats, **baseline_stats(baseline)}.items()},
        **({f"reward_filtered_{k}": v for k, v in s.collector.take_filtered_stats().items()}
           if r.filter_groups and tp.rank == 0 else {}),  # the dropped groups' counts, once per engine
        **adv_metrics,
        **summed_reward_stats(reward),  # GDPO: the plain sum's, not the normalised scores' (mean 0)
        **learn,
        **mismatch,
        **times,
    }
    return row, [dict(t, iteration=it) for t in trace]


def run_eval(s: Setup, it: int) -> dict:
    """The periodic evaluation: each engine samples its share of the problems (`kv4rl.eval.data_parallel`,
    as `kv4rl eval` under torchrun does), rank 0 gets the metrics over all of them; {} on other ranks. It
    samples with the engine's weights, `eval/policy_version` (behind the learner between refreshes when
    `staleness.refresh_every` > 1); requests in flight wait through it (`Engine.generate`: the running ones
    are preempted and re-prefilled afterwards, so a `carry: keep_kv` run's KV of old weights is recomputed)."""
    cfg = s.cfg
    problems = s.source.eval_problems(cfg.data.eval_size)
    verifier = s.reward_fn.verifier if isinstance(s.reward_fn, WeightedRewards) else s.reward_fn
    res, _ = evaluate_ranks(s.engine, s.formatter, problems, verifier, current(), k=cfg.eval.k,
                            temperature=cfg.eval.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                            seed=stream_seed(cfg.seed, EVAL_STREAM, it))
    if res is None:
        return {}
    return {**{f"eval/{k}": v for k, v in res.items()}, "eval/policy_version": s.engine.version}


def train(cfg: RunConfig, resume: bool = False, show_progress: bool = True, overwrite: bool = False) -> dict:
    """Run (or continue) training; returns a summary of the whole run.

    Every start-up check runs before the run folder is touched (see `kv4rl.run_folder`): a fresh run
    refuses a folder that holds a run unless `overwrite`; a resume takes the newest intact checkpoint.
    """
    if cfg.rollout.placement == "split":  # engines and learner on different ranks
        from kv4rl.split.run import train_split

        return train_split(cfg, resume, show_progress, overwrite)
    main = current().main  # under torchrun, rank 0 alone writes the run folder and the viewers
    sink = MetricsSink(cfg) if main else None  # checks the optional viewers before the folder is touched
    if resume:
        restore = find_restore(cfg)
        finished = finished_summary(cfg, restore)
        if finished is not None:
            return finished
    else:
        check_new_run(cfg.run_dir, overwrite, cfg)
        restore = None
    with GracefulStop() as stop:
        s = build(cfg, restore, show_progress and main)
        folder = RunFolder(cfg, restore.run_id if restore else None, s.start_iteration if restore else None,
                           overwrite, s.model_sha256) if main else None
        failing = True  # until the loop returns: then a failure to close is the error to report
        try:
            last = run_loop(s, folder, stop, show_progress and main, sink)
            failing = False
        finally:
            close_all({"run folder": None if folder is None else (lambda: folder.close(failing)),
                       "viewers": None if sink is None else (lambda: sink.close(failing)),
                       "reward workers": getattr(s.reward_fn, "close", None)}, failing)
    if folder is None:
        return summarize_run(cfg.run_dir, s.start_iteration if resume else None)
    summary = summarize_run(cfg.run_dir, s.start_iteration if resume else None, written=folder.opened)
    if folder.moved_to is not None:
        summary["previous_run_moved_to"] = str(folder.moved_to)
    if stop.requested and last < cfg.trainer.iterations:  # a signal in the last iteration stopped nothing
        written = folder.opened or restore is not None
        # `last` counts iterations done; metrics rows number them from 0
        summary["stopped_by"] = f"{stop.requested} after iteration {last - 1}" if written else \
            f"{stop.requested} before the first iteration (nothing written)"
    return summary


def eval_before_training(s: Setup, bar: TrainProgress) -> dict:
    """`eval.before_training`: the starting model's evaluation as `eval_start/*` (rank 0's; {} elsewhere), said
    on the console, with its own sampling seeds (the periodic evaluations' stream at index -1)."""
    started = time.perf_counter()
    evaluation = {f"eval_start/{key.removeprefix('eval/')}": value for key, value in run_eval(s, -1).items()}
    if evaluation:
        evaluation["eval_start/time_s"] = time.perf_counter() - started
        bar.say("eval before training  " + "  ".join(f"{key.removeprefix('eval_start/')} {value:.3f}"
                                                     for key, value in evaluation.items()
                                                     if re.fullmatch(r"eval_start/(mean|pass)@\d+", key)))
    return evaluation


def run_loop(s: Setup, folder: RunFolder | None, stop: GracefulStop, show_progress: bool,
             sink: MetricsSink | None) -> int:
    """Iterate from the start iteration to the end (or a stop signal); returns iterations done.

    Under torchrun every rank runs this loop; rank 0 (the one with a `folder`) merges the ranks' rows
    and writes them, and a stop signal seen by any rank stops all after the same iteration."""
    cfg = s.cfg
    end, done = cfg.trainer.iterations, s.start_iteration
    watch = run_watch(cfg, None if folder is None else folder.path, s.start_iteration)
    with TrainProgress(end, s.start_iteration, enabled=show_progress) as bar:
        # the starting model, once (not on resume): into the first row, where plots and viewers find it at step 0
        start_eval = eval_before_training(s, bar) if cfg.eval.before_training and s.start_iteration == 0 else {}
        for it in range(s.start_iteration, end):
            if any_rank(bool(stop.requested)):
                stop.requested = stop.requested or "a stop signal on another rank"  # said in the summary
                break
            stop.iterating = True
            row, trace = run_iteration(s, it)
            if cfg.eval.every and ((it + 1) % cfg.eval.every == 0 or it + 1 == end):
                started = time.perf_counter()
                evaluation = run_eval(s, it)  # every rank takes part (engines share the problems out)
                if evaluation:  # rank 0's: outside time_total, so a run's wall time can be accounted for
                    evaluation["eval/time_s"] = time.perf_counter() - started
                if s.engine.tp.rank == 0:  # its preemptions in this row: the last eval's reached no row
                    row["preemptions"] = s.engine.num_preemptions
                if folder is not None:
                    row.update(evaluation)  # rank 0's
            if folder is not None and start_eval:
                row.update(start_eval)
                start_eval = {}
            rows, traces = zip(*gather_objects((row, trace)))
            if folder is not None:
                row = merge_rank_rows(list(rows))
                # an engine's tensor-parallel ranks step together: its first rank's trace is the engine's
                tp = cfg.engine.tensor_parallel
                trace = traces[0] if len(traces) == 1 else \
                    [dict(t, rank=rank) for rank, steps in enumerate(traces) if rank % tp == 0 for t in steps]
                folder.write(row, trace)  # the first write opens the folder: every start-up check has passed
                sink.log(row)
                bar.update(row)
                watch.observe(row)
            done = it + 1
            if done % cfg.checkpoint.save_every == 0 or done == end or any_rank(bool(stop.requested)):
                save(s, folder, done)
    return done
