"""`trainer.fused_logprobs` on CUDA (the Triton log-prob head compiled, bf16 logits): the FSDP2 learner
takes the first update the chunked torch head takes, to bf16 rounding, padded with SDPA and packed with
FlexAttention. The kernels alone against float64: tests/test_logprob_head_kernel.py (also on CUDA)."""

import pytest
import torch

from tests.gpu.test_learner_gpu import assert_same_first_update, make, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_learner_with_the_fused_head_matches_the_torch_head(tiny_qwen3, packed):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    kw = {"max_tokens_per_micro_batch": 256, "attention": "flex"} if packed else {}
    torch_head = make(path, CUDA, **kw)
    fused_head = make(path, CUDA, fused_logprobs=True, **kw)
    assert_same_first_update(torch_head, fused_head, b)
