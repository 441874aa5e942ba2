"""Checkpoints of two gloo ranks (FSDP2, fp32 CPU): the policy as a Hugging Face folder, the AdamW state
as one DCP shard per rank. A resume from them continues bit-identically to the uninterrupted learner; a
save that fails on one rank leaves no checkpoint behind; a missing or damaged shard is named."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.checkpoint import (
    STATE_FILE,
    CheckpointError,
    check_resume_world,
    checkpoint_root,
    find_resume_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from kv4rl.trainer.learner import Learner
from kv4rl.trainer.optimizer_checkpoint import (
    OPTIMIZER_DIR,
    SHARDED,
    OptimizerShardError,
    ShardWriteError,
    shards_problem,
)
from tests.conftest import assert_plain_modes, make_checkpoint
from tests.gloo_ranks import run_on_gloo_ranks

LENGTHS = [(5, 9), (5, 3), (7, 14), (7, 2), (4, 6), (4, 11), (6, 1), (6, 8)]  # (prompt, response) per row


def half_batch(seed: int, rank: int):
    """This rank's half of a learner batch of random rows."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 90, (p,), generator=g).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(0, 90, (r,), generator=g).tolist() for _, r in LENGTHS]
    behavior = [(-torch.rand(r, generator=g) * 3).tolist() for _, r in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    full = build_batch(prompts, responses, behavior, [[0] * r for _, r in LENGTHS], adv, pad_id=0)
    half = len(LENGTHS) // 2
    return full.select(torch.arange(rank * half, (rank + 1) * half))


def learner(path) -> Learner:
    return Learner(path, None, algo=AlgoConfig(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=2, updates_per_batch=2, temperature=1.0, device=torch.device("cpu"))


def full_state(lrn: Learner) -> dict:
    """Weights and AdamW state as full plain tensors (a collective), copied: the step counts come back
    as the optimizer's own tensors, which later steps would advance."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(lrn.model, lrn.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"weights": {k: v.clone() for k, v in lrn.state_dict().items()},
            "optimizer": {name: {k: v.clone() for k, v in moments.items()} for name, moments in optim["state"].items()}}


def save(lrn: Learner, run_dir, rank: int, iteration: int):
    """What the loop saves (a checkpoint folder must hold a tokenizer: a word-level one of the vocabulary)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    weights = {k: v.detach().cpu() for k, v in lrn.state_dict().items()}
    state = {"learner": lrn.checkpoint_state(), "world": 2}
    vocab = {f"t{i}": i for i in range(lrn.model.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))

    def write_files(path: Path) -> None:
        lrn.save_pretrained(path, state=weights)
        tokenizer.save_pretrained(path)

    return save_checkpoint(run_dir if rank == 0 else None, iteration, write_files, state, "run", keep_last=5,
                           write_shards=lrn.write_shards)


def _disk_full(*args, **kwargs):
    raise OSError("rank 1's disk is full")


def _save_fail_resume(rank: int, model_dir: str, run_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    run_dir = Path(run_dir)
    torch.manual_seed(0)
    straight = learner(model_dir)
    straight.step(half_batch(0, rank))
    after_first = full_state(straight)
    save(straight, run_dir, rank, 1)

    writes = FileSystemWriter.write_data  # a save of iteration 2 whose shard write fails on rank 1 only
    if rank == 1:
        FileSystemWriter.write_data = _disk_full
    failed = None
    try:
        save(straight, run_dir, rank, 2)
    except ShardWriteError as error:  # a failed file operation: one line, exit 1 from the command
        failed = f"{error.filename}: {error.strerror}"
    FileSystemWriter.write_data = writes
    dist.barrier()
    after_failure = sorted(p.name for p in checkpoint_root(run_dir).iterdir())

    real_save = torch.save  # a save of iteration 3 whose trainer state rank 0 alone cannot write

    def rank0_disk_full(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    if rank == 0:
        torch.save = rank0_disk_full
    rank0_failed = None
    try:
        save(straight, run_dir, rank, 3)
    except OSError as error:
        rank0_failed = f"{type(error).__name__}: {error.filename}: {error.strerror}"
    torch.save = real_save
    dist.barrier()
    after_rank0_failure = sorted(p.name for p in checkpoint_root(run_dir).iterdir())

    straight.step(half_batch(1, rank))
    path, state = find_resume_checkpoint(run_dir)
    resumed = learner(path)
    resumed.load_checkpoint_state(state["learner"], path)
    resumed.step(half_batch(1, rank))
    return {"after_first": after_first, "straight": full_state(straight), "resumed": full_state(resumed),
            "failed": failed, "after_failure": after_failure, "resumed_from": path.name, "rank0_failed": rank0_failed,
            "after_rank0_failure": after_rank0_failure}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("dcp-qwen3")
    make_checkpoint(model_dir)
    run_dir = tmp_path_factory.mktemp("dcp-run")
    out = run_on_gloo_ranks(_save_fail_resume, 2, tmp_path_factory.mktemp("dcp-out"), str(model_dir), str(run_dir))
    return run_dir, out


def test_resume_from_the_shards_equals_the_uninterrupted_learner(two_ranks):
    _, ranks = two_ranks
    for got in ranks:
        assert got["resumed_from"] == "iter_000001"
        for name, weight in got["straight"]["weights"].items():
            assert torch.equal(got["resumed"]["weights"][name], weight), name
        straight, resumed = got["straight"]["optimizer"], got["resumed"]["optimizer"]
        assert straight.keys() == resumed.keys() and straight
        for name, moments in straight.items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(resumed[name][key], moments[key]), (name, key)


def test_checkpoint_holds_a_transformers_folder_and_one_shard_per_rank(two_ranks):
    run_dir, ranks = two_ranks
    path = checkpoint_root(run_dir) / "iter_000001"
    assert sorted(p.name for p in (path / OPTIMIZER_DIR).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = load_trainer_state(path)
    assert state["learner"] == {"optimizer_format": SHARDED, "world": 2}  # no gathered optimizer state
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    expected = ranks[0]["after_first"]["weights"]
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_checkpoint_files_have_the_modes_of_a_plain_open(two_ranks, tmp_path):
    """model.safetensors too (safetensors writes it 0600), and the shards rank 1 wrote."""
    run_dir, _ = two_ranks
    assert_plain_modes(checkpoint_root(run_dir) / "iter_000001", tmp_path)


def test_a_save_failing_on_one_rank_leaves_no_checkpoint(two_ranks):
    run_dir, ranks = two_ranks
    for got in ranks:  # DCP reports rank 1's failure on both ranks, so neither goes on as if saved
        assert got["failed"] is not None and "\n" not in got["failed"]
        assert "writing the optimizer shards failed (rank 1: OSError: rank 1's disk is full)" in got["failed"]
        assert got["failed"].startswith(str(checkpoint_root(run_dir) / ".tmp_iter_000002" / OPTIMIZER_DIR))
    assert ranks[0]["after_failure"] == ["iter_000001", "latest"]  # rank 0 removed the failed save's folder
    assert (checkpoint_root(run_dir) / "latest").read_text() == "iter_000001"


def test_a_save_failing_on_rank_0_alone_fails_on_every_rank_at_once(two_ranks):
    """Rank 0's own files (here the trainer state) could not be written: rank 1 stops with an error of its own
    instead of going on as if saved (or waiting at a barrier for a rank 0 that is going down)."""
    run_dir, ranks = two_ranks
    tmp = checkpoint_root(run_dir) / ".tmp_iter_000003"
    assert ranks[0]["rank0_failed"] == f"OSError: {tmp / 'trainer_state.pt'}: No space left on device"
    assert ranks[1]["rank0_failed"] == (f"SaveFailedElsewhere: {tmp}: rank 0 could not write the checkpoint "
                                        "(its error names the file)")
    assert ranks[0]["after_rank0_failure"] == ["iter_000001", "latest"]


@pytest.mark.parametrize("damage", ["truncated", "missing", "metadata"])
def test_a_damaged_shard_is_named(two_ranks, tmp_path, damage):
    run_dir, _ = two_ranks
    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns(".tmp_*"))
    shards = checkpoint_root(run) / "iter_000001" / OPTIMIZER_DIR
    file = shards / (".metadata" if damage == "metadata" else "__1_0.distcp")
    if damage == "missing":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    problem = shards_problem(shards.parent)
    assert problem is not None and problem.startswith(str(file)) and "\n" not in problem
    with pytest.raises(CheckpointError, match="no intact checkpoint") as error:
        find_resume_checkpoint(run)
    assert str(file) in str(error.value)


def test_another_number_of_ranks_is_refused_with_what_to_do(two_ranks):
    run_dir, _ = two_ranks
    path = checkpoint_root(run_dir) / "iter_000001"
    state = torch.load(path / STATE_FILE, weights_only=False)
    check_resume_world(path, state, 2)
    with pytest.raises(CheckpointError) as error:
        check_resume_world(path, state, 3)
    text = str(error.value)
    assert "written by 2 rank(s) (torchrun processes) and this job has 3" in text
    assert "optimizer shards could be resharded" in text and "in-flight rollouts" in text
    assert "torchrun --nproc-per-node 2" in text and f"model.path={path}" in text
    with pytest.raises(CheckpointError, match="one process, without torchrun"):
        check_resume_world(path, {"learner": {"optimizer": {}}}, 2)


def test_one_process_reshards_the_two_ranks_optimizer_state(two_ranks):
    """DCP reshards: one process loads the two ranks' shards into the full state the ranks held (the
    loop still refuses another number of ranks, for the per-rank rollouts)."""
    run_dir, ranks = two_ranks
    path = checkpoint_root(run_dir) / "iter_000001"
    one = learner(path)
    one.load_checkpoint_state(load_trainer_state(path)["learner"], path)
    got, expected = full_state(one)["optimizer"], ranks[0]["after_first"]["optimizer"]
    assert got.keys() == expected.keys() and expected
    for name, moments in expected.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][key], moments[key]), (name, key)


def test_a_shard_whose_bytes_do_not_load_is_named(two_ranks, tmp_path):
    run_dir, _ = two_ranks
    path = shutil.copytree(checkpoint_root(run_dir) / "iter_000001", tmp_path / "iter_000001")
    file = path / OPTIMIZER_DIR / "__0_0.distcp"
    file.write_bytes(bytes(file.stat().st_size))  # the right size, every byte zero
    assert shards_problem(path) is None  # sizes match the metadata: only reading finds it
    with pytest.raises(OptimizerShardError, match="does not load") as error:
        learner(path).load_checkpoint_state(load_trainer_state(path)["learner"], path)
    assert f"{file} does not load" in str(error.value) and "\n" not in str(error.value)
