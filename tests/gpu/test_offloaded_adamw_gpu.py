"""OffloadedAdamW on CUDA (`trainer.offload_optimizer`): after steps the moments are pinned CPU tensors
(views of one pinned arena), the parameters and gradients stay on the GPU, and a step leaves no GPU
memory behind (the staging slots are freed); the streamed steps equal torch's fused AdamW on CUDA (its
kernel, so to float32 rounding at most), alone over five steps with buckets smaller than one parameter
and larger than several, and inside the FSDP2 learner's update on the learner's own gradients.
The same maths on the CPU, and checkpoints: tests/test_offloaded_adamw.py."""

import pytest
import torch

from kv4rl.trainer.offloaded_adamw import OffloadedAdamW
from tests.test_offloaded_adamw import LRS, NEVER, assert_same, offloaded, params, run, set_step, torch_adamw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def assert_offloaded(opt: OffloadedAdamW, ps) -> None:
    """Parameters and gradients on the GPU, moments pinned in the host arena, step counts on the GPU."""
    assert opt._arena.device.type == "cpu" and opt._arena.is_pinned()
    for p in ps:
        local = p.to_local() if hasattr(p, "to_local") else p
        assert local.device.type == "cuda" and (p.grad is None or p.grad.device.type == "cuda")
        if p not in opt.state:
            continue
        state = opt.state[p]
        assert state["step"].device.type == "cuda" and state["step"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key]
            assert moment.device.type == "cpu" and moment.is_pinned() and moment.shape == local.shape, key
            assert moment.untyped_storage().data_ptr() == opt._arena.untyped_storage().data_ptr(), key


@pytest.mark.parametrize("bucket", [7, 150, 1 << 20])
def test_moments_stream_through_pinned_memory_and_equal_fused_adamw(bucket):
    ps, ref_ps = params(device=CUDA), params(device=CUDA)
    opt, ref = offloaded(ps, bucket), torch_adamw(ref_ps, fused=True)
    run(ref_ps, ref, range(len(LRS)))
    run(ps, opt, range(2))
    for step in range(2, len(LRS)):  # a later step alone keeps nothing on the GPU (staging slots freed)
        set_step(ps, opt, step)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated, step
    assert_offloaded(opt, ps)
    assert [i for i, p in enumerate(ps) if p not in opt.state] == [NEVER]
    assert_same(ps, opt, ref_ps, ref, exact=False)


def test_fsdp2_learner_update_is_fused_adamw_on_its_own_gradients(tiny_qwen3):
    from tests.gpu.test_learner_gpu import make, ragged_batch

    path, _ = tiny_qwen3
    learner = make(path, CUDA, offload_optimizer=True)
    assert isinstance(learner.optimizer, OffloadedAdamW) and "pinned CPU memory" in learner.options_desc
    ps = list(learner.model.parameters())
    before = [p.to_local().detach().clone() for p in ps]
    learner.step(ragged_batch().to(CUDA))  # one AdamW step (updates_per_batch=1); the gradients stay
    assert_offloaded(learner.optimizer, ps)
    ref_ps = [torch.nn.Parameter(b.clone()) for b in before]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.to_local().clone()
    group = learner.optimizer.param_groups[0]
    torch.optim.AdamW(ref_ps, lr=group["lr"], betas=group["betas"], weight_decay=group["weight_decay"],
                      fused=True).step()
    for i, (p, r) in enumerate(zip(ps, ref_ps)):
        assert not torch.equal(r.detach(), before[i]), i  # the update moved every parameter
        torch.testing.assert_close(p.to_local().detach(), r.detach(), rtol=1e-6, atol=1e-7, msg=str(i))
