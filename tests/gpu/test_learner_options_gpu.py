"""The learner's compiled options on CUDA, and their default (both on), against the plain learner: with `trainer.compile_layers`
(inductor's Triton kernels around the GEMMs) or `trainer.fused_logprobs` (the Triton log-prob head,
bf16 logits), the bf16 FSDP2 learner takes the first update the plain one takes, to bf16 rounding (5%,
as tests/gpu/test_fused_elementwise_gpu.py allows), padded with SDPA and packed with FlexAttention.
The log-prob head's kernels alone against float64: tests/test_logprob_head_kernel.py (also on CUDA)."""

import pytest
import torch

from tests.gpu.test_learner_gpu import assert_same_first_update, make, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("option", ["compile_layers", "fused_logprobs"])
def test_bf16_learner_with_the_option_matches_the_plain_one(tiny_qwen3, option, packed):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    kw = {"max_tokens_per_micro_batch": 256, "attention": "flex"} if packed else {}
    plain = make(path, CUDA, fuse_elementwise=False, **kw)
    other = make(path, CUDA, fuse_elementwise=False, **{option: True}, **kw)
    if option == "compile_layers":
        assert other.compiled_layers == other.model.config.num_hidden_layers
    assert_same_first_update(plain, other, b)


def test_the_cuda_default_learner_compiles_its_layers_and_runs_the_triton_head(tiny_qwen3):
    """`trainer.compile_layers` and `trainer.fused_logprobs` left null: both on for CUDA (measured
    1.19x and 1.24x per 1.7B step), and the update is still the plain learner's."""
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    kw = {"max_tokens_per_micro_batch": 256, "attention": "flex"}
    plain = make(path, CUDA, fuse_elementwise=False, **kw)
    default = make(path, CUDA, compile_layers=None, fused_logprobs=None, **kw)
    assert default.compiled_layers == default.model.config.num_hidden_layers and default.fused_logprobs
    assert_same_first_update(plain, default, b)
