"""`trainer.compile_layers` on CUDA (inductor's Triton kernels around the GEMMs): the bf16 FSDP2 learner
with every decoder layer compiled takes the first update the eager one takes, to bf16 rounding (5%, as
tests/gpu/test_fused_elementwise_gpu.py allows), padded with SDPA and packed with FlexAttention."""

import pytest
import torch

from tests.gpu.test_learner_gpu import assert_same_first_update, make, ragged_batch

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
    assert_same_first_update(eager, compiled, b)
