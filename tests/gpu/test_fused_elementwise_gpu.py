"""`trainer.fuse_elementwise` on CUDA (Triton kernels from inductor): the compiled norm and SwiGLU equal
transformers' modules in fp32, and the bf16 FSDP2 learner with them takes the first update the eager
one takes, to bf16 rounding (5%, as tests/gpu/test_learner_flex_gpu.py allows the kernels there)."""

import pytest
import torch

from kv4rl.trainer.fused_elementwise import rms_norm, silu_mul
from tests.gpu.test_learner_gpu import assert_same_first_update, make, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def test_compiled_functions_equal_the_modules_on_cuda():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator(device=CUDA).manual_seed(0)
    for rows, width in ((5, 128), (4099, 2048)):  # head-dim norms and hidden norms, two lengths
        module = Qwen3RMSNorm(width, eps=1e-6).to(CUDA)
        with torch.no_grad():
            module.weight.copy_(torch.randn(width, generator=g, device=CUDA))
        x = torch.randn(rows, width, generator=g, device=CUDA, requires_grad=True)
        want, got = module(x), rms_norm(x, module.weight, module.variance_epsilon)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        cot = torch.randn_like(got)
        torch.testing.assert_close(torch.autograd.grad(got, (x, module.weight), cot),
                                   torch.autograd.grad(want, (x, module.weight), cot), rtol=1e-4, atol=1e-4)
        a, b = (torch.randn(rows, 3 * width, generator=g, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
        torch.testing.assert_close(silu_mul(a, b), torch.nn.functional.silu(a) * b, rtol=1.6e-2, atol=1e-2)


def test_bf16_learner_with_fused_elementwise_matches_the_eager_one(tiny_qwen3):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    eager, fused = make(path, CUDA, fuse_elementwise=False), make(path, CUDA, fuse_elementwise=True)
    assert fused.fused_elementwise["rms_norm"] > 0 and fused.fused_elementwise["swiglu"] > 0
    assert_same_first_update(eager, fused, b)
