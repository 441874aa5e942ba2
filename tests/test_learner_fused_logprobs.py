"""`trainer.fused_logprobs`: the learner with the Triton log-prob head (`kv4rl.kernels.logprob_head`,
here in Triton's CPU interpreter) takes the same steps as with the chunked torch head, padded and packed,
and logs the same entropy; on a machine without the kernels the option is refused before any work."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton")

from kv4rl.algo.config import AlgoConfig  # noqa: E402
from kv4rl.config import RunConfig, TrainerConfig  # noqa: E402
from kv4rl.trainer.learner import check_learner_options  # noqa: E402
from tests.test_learner_fsdp import make, ragged_batch  # noqa: E402


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.3])
def test_the_fused_head_takes_the_same_steps_as_the_torch_head(tiny_qwen3, packed, entropy_coeff):
    """With an entropy bonus too, whose gradient each head takes its own way (test_entropy_bonus.py: the torch
    head's against verl's formula in float64)."""
    path, _ = tiny_qwen3
    kw = {"max_tokens_per_micro_batch": 24} if packed else {}
    kw["algo"] = AlgoConfig(entropy_coeff=entropy_coeff)
    torch_head, fused_head = make(path, True, **kw), make(path, True, fused_logprobs=True, **kw)
    # the default (null) is the torch head on the CPU, even with the interpreter able to run the kernels
    assert fused_head.fused_logprobs and not torch_head.fused_logprobs
    assert "log-prob head triton" in fused_head.options_desc and "log-prob head torch" in torch_head.options_desc
    for seed in (1, 2):
        m_torch, m_fused = torch_head.step(ragged_batch(seed)), fused_head.step(ragged_batch(seed))
        for key in ("loss", "grad_norm", "entropy"):
            assert m_fused[key] == pytest.approx(m_torch[key], rel=1e-5, abs=1e-7), key
    w_torch = torch_head.state_dict()
    for name, w in fused_head.state_dict().items():
        torch.testing.assert_close(w, w_torch[name], rtol=0, atol=2e-5, msg=name)


def test_the_option_is_refused_where_the_kernels_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="trainer.fused_logprobs=true needs a CUDA device"):
        RunConfig(device="cpu", trainer=TrainerConfig(fused_logprobs=True)).validate()
    assert TrainerConfig().fused_logprobs is None  # null: on for CUDA, and valid on the CPU
    RunConfig(device="cpu", trainer=TrainerConfig()).validate()
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="trainer.fused_logprobs=true runs Triton kernels"):
            check_learner_options(torch.device("cpu"), fsdp=True, offload=False, fused_logprobs=True)
