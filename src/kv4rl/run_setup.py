"""What both placements of a run build the same way: the model folder, the learner, and a resume's start.

`kv4rl.loop` (engine and learner on every rank) and `kv4rl.split.run` (engines and learner on different
ranks) share these, so they live apart from either loop.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from kv4rl.config import ConfigError, RunConfig, load_config
from kv4rl.distributed import train_launch
from kv4rl.run_folder import RunFolderError
from kv4rl.telemetry.metrics import read_jsonl
from kv4rl.telemetry.run_stats import summarize_run
from kv4rl.trainer.checkpoint import checkpoint_root, checkpoints, find_resume_checkpoint, run_of
from kv4rl.trainer.learner import Learner


def task_of_model(model_dir: Path):
    """The task a testbed folder was built for, or None (then the problem source uses its default task):
    what a run trains on when `data.train` names no file."""
    # imported here: kv4rl.models.testbed loads transformers' modeling code (and with it triton.language),
    # which `import kv4rl.loop` should not do (the CPU kernel tests switch Triton to its interpreter first)
    from kv4rl.models.testbed import task_of

    return task_of(model_dir)


def short_response_warning(cfg: RunConfig, model_dir: Path) -> str | None:
    """A testbed's answers need the response limit its build measured them with; a run on its task with a lower
    `rollout.max_new_tokens` (the default 16 is the embedded task's) cuts every one of them before its answer."""
    from kv4rl.models.testbed import read_metadata

    record = read_metadata(model_dir) or {}
    need = record.get("eval_max_new_tokens")
    if cfg.data.train or not isinstance(need, int) or cfg.rollout.max_new_tokens >= need:
        return None
    return (f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} is below the {need} tokens the build of testbed "
            f"{record.get('testbed', model_dir.name)} measured its answers with: responses will be cut before their "
            f"answers; set rollout.max_new_tokens={need} (or more), as recipes/testbed_*.yaml do")


def resolve_model_dir(cfg: RunConfig, progress: bool = True) -> Path:
    if cfg.model.testbed is not None:
        from kv4rl.models.testbed import testbed_model_dir

        return testbed_model_dir(cfg.model.testbed, progress=progress, device=cfg.device)
    if cfg.model.path is None:
        from kv4rl.models.tiny import tiny_model_dir

        return tiny_model_dir(progress=progress)
    return Path(cfg.model.path)


@dataclass
class Restore:
    """What a resume starts from: the checkpoint folder, its trainer state and the run it belongs to."""

    path: Path
    state: dict
    run_id: str | None


def find_restore(cfg: RunConfig) -> Restore:
    """The newest intact checkpoint of `cfg.run_dir`; a folder with none cannot be resumed."""
    root = checkpoint_root(cfg.run_dir)
    if root.exists() and not root.is_dir():
        raise RunFolderError(f"--resume {cfg.run_dir}: {root} is a file, not the run's checkpoints folder; move it "
                             f"away (or put the checkpoints folder back) and resume again")
    found = find_resume_checkpoint(cfg.run_dir)
    if found is None:
        # the folder given is the run, whatever name/out_dir its config.yaml recorded: say so in the command
        start_over = shlex.join([*train_launch(), "-c", str(cfg.run_dir / "config.yaml"),
                                 f"out_dir={cfg.run_dir.parent}", f"name={cfg.run_dir.name}", "--overwrite"])
        raise RunFolderError(
            f"--resume {cfg.run_dir}: no checkpoint yet (the run stopped before its first save, every "
            f"checkpoint.save_every={cfg.checkpoint.save_every} iterations); to start it over, run `{start_over}`")
    path, state = found
    written = state.get("placement", "colocated")
    if written != cfg.rollout.placement:  # the two keep different state (in-flight rollouts vs stream place)
        raise ConfigError(f"--resume {cfg.run_dir}: {path.name} was written by a {written} run (rollout.placement="
                          f"{written}) and this one is rollout.placement={cfg.rollout.placement}; resume it as it "
                          f"was written, or start a new run from its policy with model.path={path}")
    writer = run_of(path)
    # checkpoints copied in from another run: resuming from one took its weights, left this run's log with a gap
    # and took its run id, under which the folder's own checkpoints were never pruned again. A run writes each
    # iteration's row before the checkpoint after it, so its newest checkpoint never outruns its log.
    others = {run_of(p) for _, p in checkpoints(cfg.run_dir) if p != path}
    logged = [row.get("iteration") for row in read_jsonl(cfg.run_dir / "metrics.jsonl")] \
        if (cfg.run_dir / "metrics.jsonl").is_file() else []
    last = max((i for i in logged if isinstance(i, int)), default=None)
    ahead = last is not None and last < state.get("iteration", 0) - 1
    if ahead or (writer is not None and len(others) == 1 and None not in others and writer not in others):
        why = (f"its metrics.jsonl ends at iteration {last}" if ahead else
               f"the folder's other checkpoints were written by run {others.pop()}")
        raise RunFolderError(f"--resume {cfg.run_dir}: the newest checkpoint {path.name} (run id {writer}) is not "
                             f"this run's ({why}): copied in? move it out to resume from the run's own, or start a "
                             f"new run from it with model.path={path}")
    return Restore(path, state, writer)


def finished_summary(cfg: RunConfig, restore: Restore) -> dict | None:
    """The run's summary when its checkpoint is at trainer.iterations already (a resume would train
    nothing), with `nothing_trained` saying how to train longer; None when iterations remain. Such a
    resume returns this without building a model, engine or learner."""
    done = restore.state.get("iteration", 0)
    if done < cfg.trainer.iterations:
        return None
    return {**summarize_run(cfg.run_dir, done, written=False),
            "nothing_trained": f"nothing trained: {restore.path.name} has done {done} iterations and "
                               f"trainer.iterations={cfg.trainer.iterations} asks for no more; to train longer, "
                               f"give trainer.iterations above {done}"}


def write_policy_files(path: Path, learner: Learner, tokenizer, weights: dict, base_dir: Path | None) -> None:
    """A checkpoint's Hugging Face folder: the policy's `weights` (gathered already), the tokenizer, and a
    testbed's record when the run started from one, so the checkpoint keeps its task."""
    from kv4rl.models.testbed import carry_record  # not at import: it loads transformers' modeling code

    learner.save_pretrained(path, state=weights)
    tokenizer.save_pretrained(path)
    if base_dir is not None:
        carry_record(base_dir, path)


def build_learner(cfg: RunConfig, policy_dir: Path, base_dir: Path, device: torch.device, group=None) -> Learner:
    """The learner; `group`: its ranks when they are not the whole job (split placement)."""
    t = cfg.trainer
    return Learner(policy_dir, base_dir, algo=cfg.algo, lr=t.lr, weight_decay=t.weight_decay, betas=t.betas,
                   grad_clip=t.grad_clip, micro_batch_size=t.micro_batch_size,
                   updates_per_batch=t.updates_per_batch, epochs_per_batch=t.epochs_per_batch, temperature=cfg.rollout.temperature,
                   device=device, grad_checkpointing=t.grad_checkpointing, fsdp=t.fsdp, offload=t.offload,
                   max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, ref_kl_every=t.ref_kl_every,
                   attention=t.attention, group=group, fuse_elementwise=t.fuse_elementwise,
                   compile_layers=t.compile_layers, fused_logprobs=t.fused_logprobs,
                   offload_optimizer=t.offload_optimizer, max_new_tokens=cfg.rollout.max_new_tokens)


def check_same_stream(restore: Restore, now: dict, run_config: Path | None = None) -> None:
    """Refuse a resume whose training stream (`now`: `ProblemSource.stream_fingerprint`) differs from the
    checkpoint's (the dataset file edited, rows added or removed, another seed or data.shuffle): the run's
    place in it would point at other problems. A checkpoint written before the stream was recorded (before
    2026-12-05) is checked for seed and data.shuffle against the run's `run_config` (its config.yaml, not yet
    rewritten by this resume): a resume with another seed went through and recorded the new one there."""
    saved = restore.state.get("data_stream")
    if saved is None and run_config is not None and run_config.is_file():
        recorded = load_config(run_config, validate=False)  # as recorded; the resumed config was checked
        saved = {**now, "seed": recorded.seed, "shuffle": recorded.data.shuffle}
    if saved is None or saved == now:
        return
    changes = [f"{key} {saved.get(key)} -> {now.get(key)}" for key in ("rows", "seed", "shuffle", "max_prompt_tokens", "prompt_format")
               if saved.get(key) != now.get(key)] or [
        "the problems' ids, text or answers; a row without an id is named <file name>:<line>, so a renamed copy of "
        "the file differs too"]
    raise ConfigError(
        f"--resume {restore.path}: the training stream differs from the checkpoint's ({', '.join(changes)}): "
        "the run's place in it would point at other problems, repeating some and skipping others in this "
        "epoch. Resume with the same data.train contents, seed and data.shuffle (and with data.max_prompt_tokens, the "
        "same limit, data.prompt_template and data.chat_template), or start a new run from the checkpoint with "
        f"model.path={restore.path}")


def check_same_model(restore: Restore, base_dir: Path, metrics: Path) -> None:
    """Refuse a resume whose starting model is not the one the run's rows record (`model_sha256`): the
    folder at `model.path` replaced, or a testbed or the embedded model rebuilt otherwise on another machine
    or cache. The starting model is the reference of `kl_ref` and of the KL loss, so the run would go on
    against another one (QA: `kl_ref` 0.0006 -> 1.08 at the resume). Every rank reads the same files, so
    every rank refuses alike. Nothing to compare without a recorded or computable fingerprint."""
    from kv4rl.models.fingerprint import row_fingerprint
    from kv4rl.telemetry.metrics import read_lines

    if not base_dir.exists():  # said before the bare "model folder ... does not exist" of the model check
        raise ConfigError(f"--resume {restore.path}: the run's starting model {base_dir} does not exist (model.path "
                          f"in {metrics.parent / 'config.yaml'}); if the folder moved, change model.path there")
    rows = read_lines(metrics, warn=False) if metrics.is_file() else []  # a torn last line passed over
    recorded = next((row["model_sha256"] for _, row in reversed(rows)
                     if isinstance(row, dict) and isinstance(row.get("model_sha256"), str)), None)
    now = row_fingerprint(base_dir) if recorded is not None else None
    if now is None or now == recorded:
        return
    raise ConfigError(
        f"--resume {restore.path}: the starting model {base_dir} is not the one this run started from (its rows "
        f"record weights {recorded}, the folder now holds {now}): the starting model is the reference of kl_ref "
        f"and of the KL loss, so the run would go on against another one. Put the run's model back at that path, "
        f"or start a new run from the checkpoint with model.path={restore.path}")


def check_updates_per_rank(cfg, learner_ranks: int) -> None:
    """Refuse `trainer.updates_per_batch` above the responses each learner rank trains on (the learner batch's
    rows shared out over `learner_ranks`): the config's own check sees the whole batch, and a rank with fewer
    rows than optimizer steps could only fail at its first update, after the models are built and a batch
    is collected."""
    rows = cfg.rollout.quota_groups * cfg.rollout.group_size // learner_ranks
    if learner_ranks > 1 and cfg.trainer.updates_per_batch > rows:
        raise ConfigError(f"trainer.updates_per_batch={cfg.trainer.updates_per_batch} optimizer steps need at least as "
                          f"many responses on each learner rank, which trains on {rows} (rollout.quota_groups x "
                          f"rollout.group_size = {cfg.rollout.quota_groups * cfg.rollout.group_size} over "
                          f"{learner_ranks} ranks)")

