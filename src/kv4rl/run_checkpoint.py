"""A run's checkpoint seen from the loop: what it holds beyond the learner's own state (the engine's
version and lagging weights, KV calibration, every in-flight rollout), how every rank takes part in
writing it, and how a resume puts the learner, engine and pipeline back where it left them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kv4rl.distributed import barrier, current, gather_objects
from kv4rl.run_folder import RunFolder
from kv4rl.run_setup import write_policy_files
from kv4rl.trainer.checkpoint import PER_RANK, engine_slice_file, save_checkpoint

if TYPE_CHECKING:
    from kv4rl.loop import Setup

log = logging.getLogger(__name__)


def save(s: Setup, folder: RunFolder | None, done: int) -> Path | None:
    """A checkpoint of iteration `done`. Every rank takes part (the learner's full weights gathered from
    its FSDP2 shards, each rank's in-flight rollouts collected, each rank's optimizer shard written, and
    each rank's engine slice when a tensor-parallel engine lags the learner); rank 0 writes the rest."""
    weights = {k: v.detach().cpu() for k, v in s.learner.state_dict().items()}
    state = {"learner": s.learner.checkpoint_state(), **resume_state(s, done)}

    def write_files(path: Path) -> None:
        write_policy_files(path, s.learner, s.formatter.tokenizer, weights, s.base_dir)

    def write_shards(path: Path) -> None:  # every rank: its engine slice if lagging, and its optimizer shard
        if state["engine_weights"] == PER_RANK:  # before the rename rank 0 does once every rank is past here
            torch.save(s.engine.weights_state(), path / engine_slice_file(current().rank))
            barrier()
        s.learner.write_shards(path)

    return save_checkpoint(folder.path if folder else None, done, write_files, state,
                           folder.run_id if folder else None, s.cfg.checkpoint.keep_last, write_shards)


def resume_state(s: Setup, done: int) -> dict:
    """What a checkpoint needs beyond the learner: the engine's version (and weights if it lags the
    learner), what its KV format calibrated (NVFP4's scales, per rank) and every in-flight rollout, so a
    resumed run hands the learner the same batches."""
    behind = s.engine.version != done
    pipelines = gather_objects(s.pipeline.state_dict())
    calibrations = gather_objects(s.engine.kv_calibration())
    out = {
        "engine_version": s.engine.version,
        # a tensor-parallel engine holds a slice per rank: each rank saves its own (`save`), where rank 0's
        # alone, loaded everywhere, gave the other ranks rank 0's halves
        "engine_weights": (None if not behind else PER_RANK if s.engine.tp.size > 1 else s.engine.weights_state()),
        "engine_kv_calibration": None if calibrations[0] is None else calibrations,
        "engine_preemptions": gather_objects(s.engine.num_preemptions),
        "pipeline": pipelines[0],
        "data_stream": s.source.stream_fingerprint(),
        "kl_reward_coef": s.kl_coef.state_dict() if s.kl_coef is not None else None,
    }
    if len(pipelines) > 1:  # each rank's own collector: restored by the rank of the same number
        out.update(world=len(pipelines), pipeline_ranks=pipelines)
    return out


def restore_state(s: Setup, state: dict, path: Path) -> None:
    """Put the learner, engine and pipeline back where the checkpoint `path` left them (written by as
    many ranks as this job has: `check_resume_world`)."""
    s.start_iteration = state["iteration"]
    s.learner.load_checkpoint_state(state.get("learner") or {"optimizer": state["optimizer"]}, path)
    rank = current().rank
    saved = state.get("engine_weights")
    if saved is not None:  # the engine was behind the learner (refresh_every)
        if saved != PER_RANK and s.engine.tp.size > 1:  # written before each rank saved its own slice
            raise ValueError(f"{path} holds one rank's slice of the lagging tensor-parallel engine's weights (it "
                             "was written by an older kv4rl), which every rank would load; resume from a "
                             "checkpoint taken on a weight refresh, or start a new run from this one's model")
        if saved == PER_RANK:
            try:
                saved = torch.load(path / engine_slice_file(rank), map_location="cpu", weights_only=True)
            except (OSError, RuntimeError) as exc:
                raise ValueError(f"{path}: this rank's engine weights ({engine_slice_file(rank)}) do not load: "
                                 f"{exc}") from None
        s.engine.load_weights_state(saved, state["engine_version"])
    s.engine.version = state["engine_version"]
    if state.get("engine_preemptions") is not None:  # a running total over the run, as dropped_stale is
        s.engine.scheduler.num_preemptions = state["engine_preemptions"][rank]
    calibrations = state.get("engine_kv_calibration")
    if calibrations is not None:  # NVFP4's scales, per rank's engine
        s.engine.load_kv_calibration(calibrations[rank if len(calibrations) > 1 else 0])
    if s.kl_coef is not None and state.get("kl_reward_coef") is not None:  # an adaptive β goes on from where it was
        said = s.kl_coef.load_state_dict(state["kl_reward_coef"])
        if said and current().rank == 0:
            log.warning(said)
    s.pipeline.load_state_dict(state["pipeline_ranks"][current().rank] if state.get("world", 1) > 1
                               else state["pipeline"])
    if s.start_iteration - s.engine.version > s.cfg.staleness.refresh_every - 1:  # refresh_every lowered at the
        # resume: the engine kept weights older than the new schedule allows and sampled the first batch with
        # them, past a max_versions lowered with it
        s.engine.load_weights(s.learner.full_weights(), version=s.start_iteration)
    s.pipeline.check_restored(s.start_iteration)  # a staleness.max_versions lowered at the resume
