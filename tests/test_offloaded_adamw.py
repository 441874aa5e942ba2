"""OffloadedAdamW (AdamW with its moments in host memory, streamed through the device in buckets) on
CPU: the same steps as torch's AdamW, with buckets smaller than one parameter and larger than several;
state that saves and loads either way; the FSDP2 learner with it (world size 1) against the standard
one, through a checkpoint; the option refused where it cannot run. On CUDA: tests/gpu/test_offloaded_adamw_gpu.py."""

import copy
from pathlib import Path

import pytest
import torch

from kv4rl.config import ConfigError, RunConfig, TrainerConfig
from kv4rl.trainer import learner as learner_module
from kv4rl.trainer import offloaded_adamw
from kv4rl.trainer.learner import check_learner_options
from kv4rl.trainer.offloaded_adamw import OffloadedAdamW
from tests.test_learner_fsdp import make, ragged_batch

SHAPES = [(37, 5), (4,), (3, 2), (1000,), (5,), (3, 7, 11), (2, 2), (6,)]
TOTAL = sum(torch.Size(s).numel() for s in SHAPES)  # 1441 elements
SKIPPED_AT = {1: 2}  # parameter 1 has no gradient at step 2 (torch skips it: no update, no step count)
NEVER = 7  # parameter 7 never has a gradient (torch makes no state for it)
LRS = [1e-2, 1e-2, 5e-3, 2e-2, 1e-3]  # changed between steps, as the learner's warm-up does


def params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [None if SKIPPED_AT.get(i) == step or i == NEVER else torch.randn(s, generator=g)
            for i, s in enumerate(SHAPES)]


def set_step(ps, opt, step):
    """The learning rate and the gradients of `step`."""
    for group in opt.param_groups:
        group["lr"] = LRS[step]
    for p, g in zip(ps, grads(step)):
        p.grad = None if g is None else g.to(p.device)


def run(ps, opt, steps):
    for step in steps:
        set_step(ps, opt, step)
        opt.step()


def torch_adamw(ps, **kw):
    return torch.optim.AdamW(ps, lr=LRS[0], betas=(0.9, 0.99), weight_decay=0.1, **kw)


def offloaded(ps, bucket_elements):
    return OffloadedAdamW(ps, lr=LRS[0], betas=(0.9, 0.99), weight_decay=0.1, bucket_bytes=bucket_elements * 8)


def assert_same(ps, opt, ref_ps, ref, exact):
    check = (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg)) if exact else \
        (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=msg))
    for i, (p, r) in enumerate(zip(ps, ref_ps)):
        check(p.detach().cpu(), r.detach().cpu(), f"param {i}")
        assert (p in opt.state) == (r in ref.state) == (i != NEVER), i
        if i == NEVER:
            continue
        assert float(opt.state[p]["step"]) == float(ref.state[r]["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            check(opt.state[p][key].cpu(), ref.state[r][key].cpu(), f"{key} {i}")


# bucket sizes in elements: smaller than most parameters (the 1000-element one spans 144 buckets of 7, or 7
# of 150, cut at odd offsets), several small parameters in one bucket, and one bucket for all
@pytest.mark.parametrize("bucket", [7, 150, 1 << 20])
def test_streamed_steps_equal_torch_adamw(bucket):
    ps, ref_ps, fused_ps = params(), params(), params()
    opt = offloaded(ps, bucket)
    single, fused = torch_adamw(ref_ps, foreach=False), torch_adamw(fused_ps, fused=True)
    for o, pp in ((opt, ps), (single, ref_ps), (fused, fused_ps)):
        run(pp, o, range(len(LRS)))
    assert opt._bucket_numel == min(bucket, TOTAL) and len(opt._buckets) == -(-TOTAL // opt._bucket_numel)
    # torch's reference AdamW and its fused kernel (which this one runs), to float32 rounding: on the CPU
    # pieces shorter than a vector take the kernel's scalar tail loop, which may round differently
    assert_same(ps, opt, ref_ps, single, exact=False)
    assert_same(ps, opt, fused_ps, fused, exact=False)
    for p in ps[:NEVER]:
        for key in ("exp_avg", "exp_avg_sq"):  # views of the one host arena, as the parameter is shaped
            moment = opt.state[p][key]
            assert moment.device.type == "cpu" and moment.shape == p.shape
            assert moment.untyped_storage().data_ptr() == opt._arena.untyped_storage().data_ptr()
        assert opt.state[p]["step"].dtype == torch.float32


def test_state_saves_and_loads_into_the_arena_and_from_torch_adamw():
    """Two steps, `state_dict`, a fresh optimizer loads it, three more steps == five straight, whether the
    moments are loaded into the arena or left where torch's own `load_state_dict` puts them (the step
    copies them in); torch's AdamW's state loads too."""
    straight_ps = params()
    straight = offloaded(straight_ps, 150)
    run(straight_ps, straight, range(5))

    first_ps = params()
    first = offloaded(first_ps, 150)
    run(first_ps, first, range(2))
    for load in (OffloadedAdamW.load_state_dict, torch.optim.Optimizer.load_state_dict):
        saved = copy.deepcopy(first.state_dict())
        resumed_ps = [torch.nn.Parameter(p.detach().clone()) for p in first_ps]
        resumed = offloaded(resumed_ps, 150)
        load(resumed, saved)
        run(resumed_ps, resumed, range(2, 5))
        for p in resumed_ps[:NEVER]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert resumed.state[p][key].untyped_storage().data_ptr() == resumed._arena.untyped_storage().data_ptr()
        assert_same(resumed_ps, resumed, straight_ps, straight, exact=True)

    torch_ps = params()  # torch's fused AdamW's state (step on the device, fused flag) loads as well
    ref = torch_adamw(torch_ps, fused=True)
    run(torch_ps, ref, range(2))
    from_torch_ps = [torch.nn.Parameter(p.detach().clone()) for p in torch_ps]
    from_torch = offloaded(from_torch_ps, 150)
    from_torch.load_state_dict(ref.state_dict())
    run(torch_ps, ref, range(2, 5))
    run(from_torch_ps, from_torch, range(2, 5))
    assert_same(from_torch_ps, from_torch, torch_ps, ref, exact=False)


@pytest.fixture
def offload_optimizer_on_cpu(monkeypatch):
    """Let the learner build OffloadedAdamW on the CPU (the option itself is refused there: nothing to
    offload), with 32 KiB buckets (4096 elements) so the FSDP2 shards' moments cross bucket boundaries."""
    check = learner_module.check_learner_options
    monkeypatch.setattr(learner_module, "check_learner_options",
                        lambda device, **kw: check(device, **{**kw, "offload_optimizer": False}))
    monkeypatch.setattr(offloaded_adamw, "BUCKET_BYTES", 32 << 10)


def test_fsdp_learner_takes_the_standard_steps_and_resumes(tiny_qwen3, offload_optimizer_on_cpu, tmp_path):
    """Two steps as the standard FSDP2 learner takes them; its checkpoint state (the standard format) resumes
    a fresh learner that then takes its third step bit for bit."""
    path, _ = tiny_qwen3
    standard, streamed = make(path, True), make(path, True, offload_optimizer=True)
    assert type(streamed.optimizer) is OffloadedAdamW and "pinned CPU memory" in streamed.options_desc
    assert "AdamW state on cpu" in standard.options_desc
    for seed in (0, 1):
        m_standard, m_streamed = standard.step(ragged_batch(seed)), streamed.step(ragged_batch(seed))
        for key in ("loss", "grad_norm"):
            assert m_streamed[key] == pytest.approx(m_standard[key], rel=1e-6, abs=1e-7), key
    w_standard = standard.state_dict()
    for name, w in streamed.state_dict().items():
        torch.testing.assert_close(w, w_standard[name], rtol=0, atol=1e-6, msg=name)

    opt = streamed.optimizer
    assert opt._bucket_numel == 4096 and len(opt._buckets) > 10 and any(p.numel() > 4096 for p in opt._slots)

    state = streamed.checkpoint_state()  # plain CPU tensors keyed by name, as the standard learner's
    moments = state["optimizer"]["state"]
    assert moments and all(type(m[k]) is torch.Tensor and m[k].device.type == "cpu"
                           for m in moments.values() for k in ("exp_avg", "exp_avg_sq"))
    streamed.save_pretrained(tmp_path / "ckpt")
    torch.save(state, tmp_path / "ckpt" / "trainer_state.pt")
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)
    resumed = make(tmp_path / "ckpt", True, offload_optimizer=True)
    resumed.load_checkpoint_state(state)
    assert resumed.step(ragged_batch(2)) == streamed.step(ragged_batch(2))
    expected = streamed.state_dict()
    for name, w in resumed.state_dict().items():
        assert torch.equal(w, expected[name]), name


def test_the_option_is_refused_on_the_cpu_and_with_offload():
    with pytest.raises(ConfigError, match=r"trainer\.offload_optimizer=true needs a CUDA device"):
        RunConfig(device="cpu", trainer=TrainerConfig(offload_optimizer=True)).validate()
    with pytest.raises(ConfigError, match=r"trainer\.offload_optimizer=true cannot be combined with trainer\.offload"):
        RunConfig(device="cuda", trainer=TrainerConfig(offload_optimizer=True, offload=True)).validate()
    RunConfig(device="cuda", trainer=TrainerConfig(offload_optimizer=True)).validate()
    with pytest.raises(ValueError, match=r"trainer\.offload_optimizer=true streams .* on device cpu"):
        check_learner_options(torch.device("cpu"), fsdp=True, offload=False, offload_optimizer=True)
    with pytest.raises(ValueError, match=r"cannot be combined with trainer\.offload=true"):
        check_learner_options(torch.device("cuda"), fsdp=True, offload=True, offload_optimizer=True)
    check_learner_options(torch.device("cuda"), fsdp=True, offload=False, offload_optimizer=True)


def _offloaded_on_two_ranks(rank: int, model_dir: str, folder: str) -> dict:
    """One rank of two: the standard and the offloaded learner take a step; the offloaded one writes its
    DCP shard (DTensor moments over host memory), a fresh one resumes from it, and it and the standard
    one take a second step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kv4rl.algo.config import AlgoConfig
    from kv4rl.trainer.learner import Learner
    from kv4rl.trainer.optimizer_checkpoint import SHARDED
    from tests.test_optimizer_checkpoint import full_state, half_batch

    check = learner_module.check_learner_options  # what the `offload_optimizer_on_cpu` fixture does
    learner_module.check_learner_options = lambda device, **kw: check(device, **{**kw, "offload_optimizer": False})
    offloaded_adamw.BUCKET_BYTES = 32 << 10

    def build(path, offload_optimizer):
        return Learner(path, None, algo=AlgoConfig(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), grad_clip=1e9,
                       micro_batch_size=2, updates_per_batch=2, temperature=1.0, device=torch.device("cpu"),
                       offload_optimizer=offload_optimizer)

    standard, first = build(model_dir, False), build(model_dir, True)
    for lrn in (standard, first):
        lrn.step(half_batch(0, rank))
    weights = {k: v.detach().cpu() for k, v in first.state_dict().items()}
    first.write_shards(Path(folder))
    if rank == 0:
        first.save_pretrained(Path(folder), state=weights)
    dist.barrier()
    resumed = build(folder, True)
    resumed.load_checkpoint_state({"optimizer_format": SHARDED, "world": 2}, Path(folder))
    for lrn in (standard, resumed):
        lrn.step(half_batch(1, rank))
    opt = resumed.optimizer
    moments = [opt.state[p][k] for p in resumed.model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return {"dtensors_over_the_arena": all(
                isinstance(m, DTensor) and m.to_local().untyped_storage().data_ptr()
                == opt._arena.untyped_storage().data_ptr() for m in moments),
            "standard": full_state(standard), "resumed": full_state(resumed)}


def test_two_ranks_shard_the_moments_and_resume_from_dcp(tmp_path):
    """Sharded moments written and read by DCP at their offsets: a resumed learner takes the standard
    learner's second step (a moment lost or misplaced would move the weights by ~lr)."""
    from tests.conftest import make_checkpoint
    from tests.gloo_ranks import run_on_gloo_ranks

    make_checkpoint(tmp_path / "model")
    (tmp_path / "ckpt").mkdir()
    for got in run_on_gloo_ranks(_offloaded_on_two_ranks, 2, tmp_path, str(tmp_path / "model"), str(tmp_path / "ckpt")):
        assert got["dtensors_over_the_arena"]
        resumed, standard = got["resumed"], got["standard"]
        assert resumed["weights"].keys() == standard["weights"].keys()
        for name, w in resumed["weights"].items():
            # to rounding, which Adam amplifies where a gradient is near zero (1.5e-6 seen)
            torch.testing.assert_close(w, standard["weights"][name], rtol=0, atol=1e-5, msg=name)
        assert resumed["optimizer"].keys() == standard["optimizer"].keys()
        for name, moments in resumed["optimizer"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(moments[key], standard["optimizer"][name][key], rtol=1e-5, atol=1e-7,
                                           msg=f"{name} {key}")
