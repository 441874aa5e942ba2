"""`kv4rl train` with `rollout.placement: split`: engines and the learner on different ranks.

Under torchrun, ranks 0..W-K-1 hold the learner's FSDP2 shards (`kv4rl.split.learner_side`) and
the last K ranks (`rollout.engine_ranks`) each run an engine that generates without waiting for
training (`kv4rl.split.engine_side`). Rank 0 writes the run folder, as in every other layout (it is
also the rank that Hugging Face's `save_pretrained` writes from). Every setting is
checked on every rank before any model is built or the folder is touched.

`--resume` continues a split run from its newest checkpoint with the same world size and
`rollout.engine_ranks` (`kv4rl.split.resume` says what it keeps and what it samples afresh).
"""

from __future__ import annotations

import logging

import torch

from kv4rl.closing import close_all
from kv4rl.config import ConfigError, RunConfig
from kv4rl.data.source import ProblemSource
from kv4rl.distributed import Ranks, barrier, current
from kv4rl.engine.placement import resolve_device
from kv4rl.graceful_stop import GracefulStop
from kv4rl.models.fingerprint import row_fingerprint
from kv4rl.models.hf_weights import load_tokenizer
from kv4rl.rollout.build import build_rollout
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
from kv4rl.split.channel import EngineLink, HeadLink, SplitGroups, make_groups, weight_manifest
from kv4rl.split.engine_side import EngineSide, run_engine
from kv4rl.split.learner_side import LearnerSide, run_learner
from kv4rl.split.resume import Consumed, check_split_resume
from kv4rl.telemetry.run_stats import summarize_run
from kv4rl.telemetry.sinks import MetricsSink
from kv4rl.trainer.learner_options import check_learner_options

log = logging.getLogger(__name__)


def check_split(cfg: RunConfig, world: int) -> None:
    """Refuse a split run that cannot work, naming the setting (before any work)."""
    k, q = cfg.rollout.engine_ranks, cfg.rollout.quota_groups
    if world < 2:
        raise ConfigError("rollout.placement=split runs engines and the learner on different ranks: start it under "
                          "torchrun with at least 2 processes (torchrun --nproc-per-node 2 -m kv4rl.cli train ...)")
    if not 1 <= k < world:
        raise ConfigError(f"rollout.engine_ranks={k} must leave the learner at least one of the {world} ranks "
                          f"torchrun started (1 <= rollout.engine_ranks <= {world - 1})")
    checks = [
        (q % k == 0, f"rollout.quota_groups={q} must split evenly over the {k} engine ranks "
                     "(each engine sends its share of every learner batch; a group is never split)"),
        (q % (world - k) == 0, f"rollout.quota_groups={q} must split evenly over the {world - k} learner ranks"),
        (cfg.engine.tensor_parallel == 1, "engine.tensor_parallel > 1 runs only with rollout.placement=colocated"),
        (not cfg.engine.sleep_between_rollouts, "engine.sleep_between_rollouts frees an engine's memory for a "
                                                "learner on the same device; with rollout.placement=split they are "
                                                "on different ranks: set it to false"),
        (cfg.eval.every == 0, "eval.every > 0 runs only with rollout.placement=colocated; evaluate a split run's "
                              "checkpoints with `kv4rl eval --model <checkpoint>`"),
        (not cfg.eval.before_training, "eval.before_training runs only with rollout.placement=colocated; evaluate "
                                       "the starting model with `kv4rl eval --model <model>`"),
        (cfg.telemetry.attribution_every == 0, "telemetry.attribution_every runs in one process; set it to 0"),
        (cfg.advantage.kl_reward_coef == 0, "advantage.kl_reward_coef runs only with rollout.placement=colocated (the "
                                            "head takes the advantages of a split run, without the learner's models)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_updates_per_rank(cfg, world - k)


def train_split(cfg: RunConfig, resume: bool, show_progress: bool, overwrite: bool) -> dict | None:
    """Run a split training job; the summary on the rank that writes the run, None on the others."""
    summary, _ = run_split(cfg, resume, show_progress, overwrite)
    return summary


def run_split(cfg: RunConfig, resume: bool, show_progress: bool, overwrite: bool) -> tuple[dict | None, dict | None]:
    """`train_split`, plus what this rank saw at the end: on rank 0 (the learner's head), the engines'
    final reports and the batches sent but never consumed; on an engine, its own report; None on the
    other learner ranks."""
    ranks = current()
    check_split(cfg, ranks.world)
    restore = find_restore(cfg) if resume else None
    if restore is not None:
        finished = finished_summary(cfg, restore)
        if finished is not None:
            return (finished if ranks.main else None), None
        check_split_resume(cfg, restore.path, restore.state, ranks.world)
    k = cfg.rollout.engine_ranks
    learners = ranks.world - k
    device = resolve_device(cfg.device)
    if ranks.rank < learners:
        try:
            check_learner_options(device, fsdp=cfg.trainer.fsdp, offload=cfg.trainer.offload,
                                  attention=cfg.trainer.attention, fused_logprobs=cfg.trainer.fused_logprobs,
                                  offload_optimizer=cfg.trainer.offload_optimizer)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    head = ranks.main
    sink = MetricsSink(cfg) if head else None  # checks the optional viewers before the folder is touched
    if restore is None:
        check_new_run(cfg.run_dir, overwrite, cfg)
    torch.manual_seed(cfg.seed)
    source = ProblemSource(cfg.data.train, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size,
                           **cfg.data.prompt_limit()) \
        if cfg.data.train is not None and ranks.rank >= learners else None
    groups = make_groups(k, ranks.world)
    if not ranks.main:  # rank 0 builds a missing embedded model or testbed into the cache first
        barrier()
    base_dir = resolve_model_dir(cfg, progress=show_progress and head)
    if ranks.main:
        barrier()
    model_sha256 = row_fingerprint(base_dir) if head else None  # the config's model, also on resume
    if head and (short := short_response_warning(cfg, base_dir)) is not None:
        log.warning(short)
    # every rank checks a resume's stream and the head records it: the learner ranks read no problems otherwise
    stream = (source or ProblemSource(cfg.data.train, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size,
                                      task=None if cfg.data.train else task_of_model(base_dir),
                                      **cfg.data.prompt_limit())).stream_fingerprint()
    if restore is not None:
        check_same_stream(restore, stream, cfg.run_dir / "config.yaml")
        check_same_model(restore, base_dir, cfg.run_dir / "metrics.jsonl")
    with GracefulStop() as stop:
        if ranks.rank >= learners:
            return None, _engine(cfg, groups, ranks.rank - learners, device, source, base_dir, restore, stop)
        return _learner(cfg, groups, head, device, base_dir, restore, stop, show_progress and head, sink, overwrite,
                        model_sha256, stream)


def _engine(cfg: RunConfig, groups: SplitGroups, engine: int, device: torch.device, source: ProblemSource | None,
            base_dir, restore: Restore | None, stop: GracefulStop) -> dict:
    if source is None:
        source = ProblemSource(None, cfg.data.eval, cfg.seed, cfg.data.shuffle, cfg.data.pool_size,
                               task=task_of_model(base_dir), **cfg.data.prompt_limit())
    policy_dir = base_dir if restore is None else restore.path
    formatter, reward_fn, llm, collector = build_rollout(
        cfg, source, base_dir, policy_dir, device, Ranks(engine, cfg.rollout.engine_ranks), show_progress=False)
    first = 0
    if restore is not None:  # the checkpoint's weights as version u; its batch u onwards, consumed groups skipped
        first = llm.version = restore.state["iteration"]
        place = restore.state["stream"][engine]
        collector.start_at(place["next"], place["beyond"])
    side = EngineSide(cfg, engine, llm, collector, formatter, reward_fn, EngineLink(groups, device), stop,
                      first_batch=first)
    failing = True
    try:
        stop.iterating = True  # built: a stop signal now ends after the batch in hand
        result = run_engine(side)
        failing = False
        return result
    finally:
        close_all({"reward workers": getattr(reward_fn, "close", None)}, failing)


def _learner(cfg: RunConfig, groups: SplitGroups, head: bool, device: torch.device, base_dir,
             restore: Restore | None, stop: GracefulStop, show_progress: bool, sink: MetricsSink | None,
             overwrite: bool, model_sha256: str | None, stream: dict) -> tuple[dict | None, dict | None]:
    tokenizer = load_tokenizer(base_dir)
    policy_dir = base_dir if restore is None else restore.path
    learner = build_learner(cfg, policy_dir, base_dir, device, group=groups.learner)
    start = 0
    if restore is not None:
        start = restore.state["iteration"]
        learner.load_checkpoint_state(restore.state["learner"], restore.path)
    link = HeadLink(groups, weight_manifest(learner.model.named_parameters())) if head else None
    consumed = Consumed(cfg.rollout.engine_ranks, restore.state["stream"] if restore else None) if head else None
    side = LearnerSide(cfg, learner, tokenizer, groups, link, consumed, base_dir, stream)
    folder = RunFolder(cfg, restore.run_id if restore else None, start if restore else None, overwrite,
                       model_sha256) if head else None
    failing = True
    try:
        stop.iterating = True
        done, end = run_learner(side, folder, stop, show_progress, sink, start)
        failing = False
    finally:
        close_all({"run folder": None if folder is None else (lambda: folder.close(failing)),
                   "viewers": None if sink is None else (lambda: sink.close(failing))}, failing)
    if not head:
        return None, None
    summary = summarize_run(cfg.run_dir, start if restore else None, written=folder.opened)
    unconsumed = [g for batch in end["unconsumed_batches"] for g in batch]
    held = [g for report in end["engines"] for g in report["held"]]
    summary.update(engine_ranks=cfg.rollout.engine_ranks, groups_sent_unconsumed=len(unconsumed),
                   groups_in_flight_at_end=len(held))
    if folder.moved_to is not None:
        summary["previous_run_moved_to"] = str(folder.moved_to)
    if done < cfg.trainer.iterations:  # a signal (here or on another rank) in the last update stopped nothing
        # `done` counts updates done; metrics rows number them from 0, as the colocated summary says them
        summary["stopped_by"] = f"{stop.requested or 'a stop signal on another rank'} after iteration {done - 1}"
    return summary, end
