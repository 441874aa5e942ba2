"""The learner ranks of a split run: consume one batch per engine per update, train, send weights.

The head (rank 0, the learner's first rank) receives each engine's next batch (`time_learner_wait` is how
long it waited for them), checks every token against the staleness bound, computes the advantages
over the whole learner batch as one process does, and hands each learner rank its share of the
groups; all learner ranks run the FSDP2 update; every `staleness.refresh_every` updates the head
broadcasts the new weights to the engines, the other learner ranks taking part in the gathers. The
head writes the metrics row of every update and keeps which groups it consumed; every checkpoint
holds what a resume needs (`kv4rl.split.resume`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kv4rl.algo.advantages import compute_advantages, noise_key
from kv4rl.graceful_stop import GracefulStop
from kv4rl.rewards import RewardResult, reward_metrics, summed_reward_stats
from kv4rl.run_folder import RunFolder
from kv4rl.run_setup import write_policy_files
from kv4rl.split.channel import HeadLink, SplitGroups
from kv4rl.split.resume import Consumed, checkpoint_state
from kv4rl.telemetry.progress import TrainProgress
from kv4rl.telemetry.run_stats import collection_stats, mean_known, staleness_stats, stepped, sum_known
from kv4rl.telemetry.run_watch import run_watch
from kv4rl.telemetry.sinks import MetricsSink
from kv4rl.trainer.batch import build_batch, untrained_rows
from kv4rl.trainer.checkpoint import save_checkpoint
from kv4rl.trainer.learner import Learner


class StalenessViolation(RuntimeError):
    """A token reached the learner older than `staleness.max_versions` (or from a future version)."""


@dataclass
class LearnerSide:
    cfg: object  # RunConfig
    learner: Learner
    tokenizer: object
    groups: SplitGroups
    link: HeadLink | None  # the head's only
    consumed: Consumed | None = None  # the head's only: the stream positions taken, for checkpoints
    base_dir: Path | None = None  # the starting model's folder (a testbed's record goes into each checkpoint)
    data_stream: dict | None = None  # `ProblemSource.stream_fingerprint`, kept by each checkpoint

    @property
    def head(self) -> bool:
        return self.link is not None


def check_versions(update: int, groups, max_versions: int | None) -> None:
    """Every token of the batch for `update`: sampled by a version in [update - max_versions, update],
    versions never decreasing along a response."""
    for g in groups:
        for j, c in enumerate(g.completions):
            where = f"update {update}, group {g.index}, response {j}"
            if any(b < a for a, b in zip(c.versions, c.versions[1:], strict=False)):
                raise StalenessViolation(f"{where}: token versions go down ({c.versions})")
            if c.versions and max(c.versions) > update:
                raise StalenessViolation(f"{where}: a token of version {max(c.versions)} (the learner is at {update})")
            if c.versions and max_versions is not None and update - min(c.versions) > max_versions:
                raise StalenessViolation(f"{where}: a token of version {min(c.versions)} is {update - min(c.versions)} "
                                         f"versions old, over staleness.max_versions={max_versions}")


def _head_batch(s: LearnerSide, it: int, messages: list[dict]) -> tuple[list, dict]:
    """The head's part: check the batch, compute advantages, split it into the learner ranks' shares."""
    cfg = s.cfg
    size = cfg.rollout.group_size
    sent = [RewardResult(m["scores"], {}, m["reward_components"], m.get("reward_summed")) for m in messages]
    scored = [(g, reward.rows(j * size, (j + 1) * size),
               m["baseline_scores"][j] if m.get("baseline_scores") is not None else None)
              for m, reward in zip(messages, sent) for j, g in enumerate(m["groups"])]
    if cfg.rollout.mode == "sync":  # in prompt order, as one process trains a sync batch (in engine order two
        # engines' groups came as 0, 2, 1, 3: with trainer.updates_per_batch > 1 each mini-batch held others)
        scored.sort(key=lambda pair: pair[0].index)
    groups = [g for g, _, _ in scored]
    check_versions(it, groups, cfg.staleness.max_versions)
    completions = [c for g in groups for c in g.completions]
    reward = RewardResult.joined([part for _, part, _ in scored])
    rewards = torch.tensor(reward.scores, dtype=torch.float64)
    baselines = (torch.tensor([b for _, _, b in scored], dtype=torch.float64)
                 if cfg.advantage.estimator == "remax" else None)
    keys = [noise_key(cfg.seed, it, g.index) for g in groups]
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
    advantages, adv_metrics = compute_advantages(rewards, size, cfg.advantage, group_keys=keys, lengths=lengths,
                                                 baselines=baselines)
    adv = advantages.tolist()
    ranks = dist.get_world_size(s.groups.learner)
    # whole groups dealt in turn (rank r: groups r, r + R, ...), as the colocated ranks hold theirs, so that
    # each rank's u-th mini-batch joins the others' into the u-th of one process
    shares = [([(g.prompt_ids, c.token_ids, c.logprobs, c.versions, c.finish_reason == "length")
                for g in groups[r::ranks] for c in g.completions],
               [a for i in range(r, len(groups), ranks) for a in adv[i * size:(i + 1) * size]]) for r in range(ranks)]
    num_gen = sum(len(c.token_ids) for c in completions)
    engines = len(messages)
    row = {
        **reward_metrics(reward, messages[0]["verifier"]),
        "response_len_mean": num_gen / len(completions),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "tokens_per_s": sum_known(sum(len(c.token_ids) for g in m["groups"] for c in g.completions)
                                   / max(m["time_rollout"], 1e-9) if stepped(m["trace"]) else None for m in messages),
        **staleness_stats(it, completions),
        "decode_steps": sum(len(m["trace"]) for m in messages) / engines,
        "slot_util": mean_known(collection_stats(m["trace"], cfg.rollout.max_slots)["slot_util"] for m in messages),
        "preemptions": sum(m["preemptions"] for m in messages),
        "dropped_stale": sum(m["dropped_stale"] for m in messages),
        **({"filtered_groups": sum(len(m["filtered_groups"]) for m in messages)} if cfg.rollout.filter_groups else {}),
        **{f"reward_filtered_{k}": sum(m.get("filtered_stats", {}).get(k, 0.0) for m in messages)
           for k in dict.fromkeys(k for m in messages for k in m.get("filtered_stats", {}))},
        "engine_version_min": min(m["version"] for m in messages),
        "groups": sorted(g.index for g in groups),
        **{f"reward_{k}": sum(m["reward_stats"].get(k, 0.0) for m in messages)  # counts, any engine's (a verl
           for k in dict.fromkeys(k for m in messages for k in m["reward_stats"])},  # scorer's key may be on one)
        **adv_metrics,
        **summed_reward_stats(reward),  # GDPO: the plain sum's, not the normalised scores' (mean 0)
        **{k: max(m[k] for m in messages) for k in ("time_rollout", "time_reward", "time_engine_wait",
                                                    "time_engine_sync")},
    }
    return shares, row


def update(s: LearnerSide, it: int, stop: GracefulStop) -> tuple[dict | None, list[dict], bool]:
    """One learner update on every learner rank; the head's metrics row and engine trace, and whether
    the run stops after it (a stop signal on any learner rank or engine)."""
    cfg, t0 = s.cfg, time.perf_counter()
    stopping, row, trace, share = bool(stop.requested), None, [], [None]
    if s.head:
        messages = s.link.receive()
        wait = time.perf_counter() - t0
        stopping = stopping or any(m["stop"] for m in messages)
        shares, row = _head_batch(s, it, messages)
        # the groups dropped for equal scores are used up too: a resume must not sample them again
        s.consumed.take([g.index for m in messages for g in m["groups"]]
                        + [index for m in messages for index in m["filtered_groups"]])
        row = {"iteration": it, **row, "time_learner_wait": wait}
        trace = [dict(t, engine=m["engine"], iteration=it) for m in messages for t in m["trace"]]
    dist.scatter_object_list(share, shares if s.head else None, group=s.groups.learner, group_src=0)
    rows, adv = share[0]
    t1 = time.perf_counter()
    pad_id = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    untrained = untrained_rows([r[4] for r in rows] if cfg.trainer.mask_truncated else None, list(adv),
                               cfg.trainer.mask_zero_advantage)
    batch = build_batch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                        adv, pad_id, untrained)
    learn = s.learner.step(batch, lr=cfg.trainer.learning_rate(it), iteration=it)
    t2 = time.perf_counter()
    flag = torch.tensor([int(stopping)], dtype=torch.long)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=s.groups.learner)
    stopping = bool(flag.item())
    last = stopping or it + 1 == cfg.trainer.iterations
    if (it + 1) % cfg.staleness.refresh_every == 0 and not last:  # nobody would sample with the last weights
        if s.head:
            s.link.broadcast(s.learner.full_weights(), version=it + 1)
        else:
            for _ in s.learner.full_weights():  # the gathers are collectives of the learner ranks
                pass
    if row is not None:
        row.update(learn, time_update=t2 - t1, time_sync=time.perf_counter() - t2,
                   time_sleep_wake=0.0,  # a split engine never sleeps; every row carries the key (README)
                   time_total=time.perf_counter() - t0)
    return row, trace, stopping


def run_learner(s: LearnerSide, folder: RunFolder | None, stop: GracefulStop, show_progress: bool,
                sink: MetricsSink | None, start: int = 0) -> tuple[int, dict | None]:
    """Updates `start`.. until `trainer.iterations` (or a stop signal); returns the updates done and, on
    the head, what the engines reported at the end (batches sent but never consumed, groups still in
    flight)."""
    cfg, done = s.cfg, start
    end = cfg.trainer.iterations
    watch = run_watch(cfg, None if folder is None else folder.path, start)
    with TrainProgress(end, start, enabled=show_progress) as bar:
        for it in range(start, end):
            row, trace, stopping = update(s, it, stop)
            if folder is not None:
                folder.write(row, trace)
                sink.log(row)
                bar.update(row)
                watch.observe(row)
            done = it + 1
            if done % cfg.checkpoint.save_every == 0 or done == end or stopping:
                save(s, folder, done)
            if stopping:
                break
    if not s.head:
        return done, None
    unused, reports = s.link.stop()
    return done, {"unconsumed_batches": [[g.index for g in m["groups"]] for m in unused], "engines": reports}


def save(s: LearnerSide, folder: RunFolder | None, done: int) -> Path | None:
    """Checkpoint update `done`: the policy as a Hugging Face folder (the learner ranks gather it; the
    head writes), the optimizer state (each learner rank's DCP shard, or the full state with one
    learner rank) and the head's stream place (`kv4rl.split.resume`)."""
    weights = {k: v.detach().cpu() for k, v in s.learner.state_dict().items()}
    state = checkpoint_state(dist.get_world_size(), s.groups.engines, s.learner.checkpoint_state(), s.consumed)
    state["data_stream"] = s.data_stream

    def write_files(to: Path) -> None:
        write_policy_files(to, s.learner, s.tokenizer, weights, s.base_dir)

    # every learner rank joins the save (its collectives run on the learner group); rank 0 writes
    return save_checkpoint(folder.path if folder is not None else None, done, write_files, state,
                           folder.run_id if folder is not None else None, s.cfg.checkpoint.keep_last,
                           write_shards=s.learner.write_shards, group=s.groups.learner)

