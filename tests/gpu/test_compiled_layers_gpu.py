"""`trainer.compile_layers` on CUDA (inductor's Triton kernels around the GEMMs): the bf16 FSDP2 learner
with every decoder layer compiled takes the first update the eager one takes, to bf16 rounding (5%, as
tests/gpu/test_fused_elementwise_gpu.py allows), padded with SDPA and packed with FlexAttention."""

import pytest
import torch

from tests.gpu.test_learner_gpu import _rel, make, on_policy, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_learner_with_compiled_layers_matches_the_eager_one(tiny_qwen3, packed):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    kw = {"max_tokens_per_micro_batch": 256, "attention": "flex"} if packed else {}
    eager = make(path, CUDA, fuse_elementwise=False, **kw)
    compiled = make(path, CUDA, fuse_elementwise=False, compile_layers=True, **kw)
    assert compiled.compiled_layers == compiled.model.config.num_hidden_layers
    mask = b.response_mask.bool()
    lp_eager, lp_compiled = eager._logprobs(eager.model, b), compiled._logprobs(compiled.model, b)
    assert float((lp_compiled - lp_eager)[mask].abs().max()) < 0.1
    b = on_policy(b, lp_eager)
    m_eager, m_compiled = eager.step(b), compiled.step(b)
    assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=0.05)
    grads = compiled.named_grads()
    for name, g in eager.named_grads().items():
        assert _rel(grads[name], g) < 0.05, name
