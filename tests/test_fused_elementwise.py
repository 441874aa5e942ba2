"""`trainer.fuse_elementwise`: the learner's RMSNorms and SwiGLU products through compiled functions
take the same steps as transformers' own modules (fp32, CPU: inductor's C++ kernels; the GPU path
is the same compiled functions with Triton kernels, timed by `kv4rl bench learner --fuse-elementwise`).
"""

import pytest
import torch
from torch import nn

from kv4rl.config import RunConfig, TrainerConfig
from kv4rl.trainer.fused_elementwise import can_fuse, fuse_elementwise, rms_norm, silu_mul
from tests.test_learner_fsdp import make, ragged_batch


def test_compiled_functions_equal_transformers_modules_and_float64():
    """The norm against transformers' own Qwen3RMSNorm (its fp32 normalisation included) and float64
    maths, values and gradients; SwiGLU against float64."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(0)
    for rows in (3, 17):  # two lengths: one dynamic-shape compilation serves both
        module = Qwen3RMSNorm(24, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(torch.randn(24, generator=g))
        x = torch.randn(rows, 2, 24, generator=g, requires_grad=True)
        want = module(x)
        got = rms_norm(x, module.weight, module.variance_epsilon)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        x64, w64 = x.detach().double(), module.weight.detach().double()
        exact = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
        cot = torch.randn_like(got)
        torch.testing.assert_close(torch.autograd.grad(got, (x, module.weight), cot),
                                   torch.autograd.grad(want, (x, module.weight), cot), rtol=1e-5, atol=1e-6)
        a, b = torch.randn(rows, 40, generator=g), torch.randn(rows, 40, generator=g)
        a64 = a.double()
        torch.testing.assert_close(silu_mul(a, b).double(), a64 * torch.sigmoid(a64) * b.double(), rtol=1e-6, atol=1e-6)


def test_fused_learner_takes_the_same_steps_as_the_eager_one(tiny_qwen3):
    path, _ = tiny_qwen3
    eager, fused = make(path, True), make(path, True, fuse_elementwise=True)
    layers = fused.model.config.num_hidden_layers
    # every layer: input, post-attention, q and k norms, and its MLP; then the final norm
    assert fused.fused_elementwise == {"rms_norm": 4 * layers + 1, "swiglu": layers}
    assert eager.fused_elementwise is None
    batch = ragged_batch(0)
    torch.testing.assert_close(fused.logprobs(batch), eager.logprobs(batch), rtol=0, atol=1e-5)
    for seed in (0, 1):
        m_eager, m_fused = eager.step(ragged_batch(seed)), fused.step(ragged_batch(seed))
        assert m_fused["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-4)
        assert m_fused["loss"] == pytest.approx(m_eager["loss"], rel=1e-4, abs=1e-6)
    w_eager, w_fused = eager.state_dict(), fused.state_dict()
    for name, w in w_fused.items():
        torch.testing.assert_close(w, w_eager[name], rtol=0, atol=1e-5, msg=name)


def test_a_model_without_a_known_norm_is_refused_by_name():
    with pytest.raises(ValueError, match="trainer.fuse_elementwise: Sequential has no RMSNorm"):
        fuse_elementwise(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


def test_by_default_only_a_cuda_learner_with_a_known_norm_fuses(tiny_qwen3):
    path, _ = tiny_qwen3
    assert make(path, False).fused_elementwise is None  # CPU: compiling costs more than it saves
    from transformers import AutoModelForCausalLM, GPT2Config

    assert can_fuse(AutoModelForCausalLM.from_pretrained(path))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    assert not can_fuse(gpt2)  # LayerNorm: the CUDA default leaves such a model eager instead of refusing it


def test_the_setting_is_a_trainer_option():
    assert TrainerConfig().fuse_elementwise is None  # on for CUDA
    RunConfig(device="cpu", trainer=TrainerConfig(fuse_elementwise=False)).validate()
    RunConfig(device="cpu", trainer=TrainerConfig(fuse_elementwise=True)).validate()
