"""The learner on CUDA: FSDP2 with bf16 mixed precision against the plain bf16-autocast path and an
fp32 CPU reference, CPU offload, and packed against padded micro-batches.

Expected: bf16 paths agree with the fp32 reference to bf16 accuracy (gradients within a few percent
in L2, per-token log-probs within a few hundredths), the first AdamW update has the fp32 sign on
almost every element, offload changes nothing but where the state lives, and packed micro-batches
give the padded log-probs to bf16 accuracy with no attention across sequences.
"""

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def ragged_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [(30, 50), (12, 200), (64, 7), (5, 90), (40, 40), (20, 130)]
    prompts = [torch.randint(0, 96, (p,), generator=g).tolist() for p, _ in sizes]
    responses = [torch.randint(0, 96, (r,), generator=g).tolist() for _, r in sizes]
    adv = torch.randn(len(sizes), generator=g).tolist()
    return build_batch(prompts, responses, [[-4.0] * len(r) for r in responses], [[0] * len(r) for r in responses],
                       adv, pad_id=0)


def make(path, device, **kw):
    return Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=3, updates_per_batch=1, temperature=1.0, device=device, **kw)


def _rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def fp32_reference(tiny_qwen3):
    """One step of the plain fp32 learner on the CPU: weights before and after, gradients, log-probs."""
    path, _ = tiny_qwen3
    ref = make(path, torch.device("cpu"), fsdp=False)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    logp = ref._logprobs(ref.model, ragged_batch())
    ref.step(ragged_batch())
    return before, ref.named_grads(), ref.state_dict(), logp


@pytest.mark.parametrize("kw", [{"fsdp": True}, {"fsdp": False}, {"fsdp": True, "offload": True}],
                         ids=["fsdp2", "autocast", "fsdp2-offload"])
def test_bf16_update_matches_fp32_to_bf16_accuracy(tiny_qwen3, fp32_reference, kw):
    path, _ = tiny_qwen3
    before, grads32, after32, logp32 = fp32_reference
    learner = make(path, CUDA, **kw)
    b = ragged_batch()
    mask = b.response_mask.bool()
    logp = learner._logprobs(learner.model, b.to(CUDA)).cpu()
    assert float((logp - logp32)[mask].abs().max()) < 0.1
    learner.step(b)
    grads = learner.named_grads()
    assert grads.keys() == grads32.keys()
    for name, g in grads.items():
        assert _rel(g, grads32[name]) < 0.05, name
    after = learner.state_dict()
    for name, w in after.items():
        assert type(w) is torch.Tensor and w.dtype == torch.float32, name  # fp32 master weights, plain
        step, step32 = w.cpu() - before[name], after32[name] - before[name]
        moved = step32 != 0
        agree = float((torch.sign(step[moved]) == torch.sign(step32[moved])).float().mean())
        assert agree > 0.95, (name, agree)


def test_packed_equals_padded_on_cuda_and_never_crosses_sequences(tiny_qwen3):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    mask = b.response_mask.bool()
    padded, packed = make(path, CUDA), make(path, CUDA, max_tokens_per_micro_batch=512)
    assert len(packed.micro_batches(b, torch.arange(len(b), device=CUDA))) < len(b)  # some rows share a row
    lp_padded, lp_packed = padded._logprobs(padded.model, b), packed._logprobs(packed.model, b)
    assert float((lp_packed - lp_padded)[mask].abs().max()) < 0.1
    m_padded, m_packed = padded.step(b), packed.step(b)
    assert m_packed["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=0.05)
    for name, g in padded.named_grads().items():
        assert _rel(packed.named_grads()[name], g) < 0.05, name

    pair = b.select(slice(0, 2))
    base = packed._logprobs(packed.model, pair)
    changed = pair.select(slice(0, 2))
    changed.input_ids = pair.input_ids.clone()
    changed.input_ids[0, :80] = (pair.input_ids[0, :80] + 11) % 96
    after = packed._logprobs(packed.model, changed)
    assert float((after[0] - base[0]).abs().max()) > 0.1
    valid = pair.response_mask[1].bool()
    torch.testing.assert_close(after[1][valid], base[1][valid], rtol=0, atol=1e-6)
