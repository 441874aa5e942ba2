"""The learner on CUDA: FSDP2 with bf16 mixed precision against the plain bf16-autocast path and an
fp32 CPU reference, CPU offload, and packed against padded micro-batches.

Expected: bf16 paths agree with the fp32 reference to bf16 accuracy, the first AdamW update has the
fp32 sign on almost every element, offload changes nothing but where the state lives, and packed
micro-batches give the padded log-probs to bf16 accuracy with no attention across sequences.

Like for like: every learner here starts from weights already rounded to bf16, so FSDP2's cast to
bf16 parameters is exact and the reference computes the same function (on this sharp test model,
rounding the weights alone moves each gradient by ~10% in L2, which says nothing about the
learner). "bf16 accuracy" per parameter is measured, not guessed: float64 maths with every module
output and its gradient rounded to bf16 (what kernels that accumulate in fp32 between bf16 tensors
do) moves the gradients by about 1-2% here; real kernels also round inside (e.g. attention
probabilities), so each gradient may differ from the reference by up to 4x its emulated error (at
least 5%). A wrong gradient (a lost micro-batch, a mis-scaled loss, a leak across rows) is off by
far more.
"""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

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


def on_policy(batch, logp):
    """`batch` with the behaviour log-probs set to `logp` on the response tokens: the importance ratio
    starts at 1, as in an on-policy step, so no token sits near PPO's clip boundary. With the fixed
    behaviour log-prob of `ragged_batch`, many do, and bf16 rounding of the log-probs (~0.05) flips
    tokens in and out of the clipped set: on this model that alone moved every gradient by ~15%
    (FSDP2 with bf16 parameters, reproduced on the CPU), which says nothing about the learner."""
    out = batch.select(slice(None))
    out.behavior_logprobs = (logp.to(batch.behavior_logprobs) * batch.response_mask).detach()
    return out


def make(path, device, **kw):
    """A learner without the compiled options (their CUDA default is on) unless a test asks for them:
    these tests compare paths that the options do not touch, and compiling costs each one minutes."""
    kw = {"compile_layers": False, "fused_logprobs": False} | kw
    return Learner(path, None, algo=AlgoConfig(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=3, updates_per_batch=1, temperature=1.0, device=device, **kw)


def _rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm().clamp(min=1e-30))


def assert_same_first_update(eager, other, batch):
    """`other` (the same weights through other kernels) gives `eager`'s log-probs and first update to
    bf16 rounding: log-probs within 0.1, grad norm and every gradient within 5%."""
    mask = batch.response_mask.bool()
    lp_eager, lp_other = eager._logprobs(eager.model, batch), other._logprobs(other.model, batch)
    assert float((lp_other - lp_eager)[mask].abs().max()) < 0.1
    batch = on_policy(batch, lp_eager)
    m_eager, m_other = eager.step(batch), other.step(batch)
    assert m_other["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=0.05)
    grads = other.named_grads()
    for name, g in eager.named_grads().items():
        assert _rel(grads[name], g) < 0.05, name


class _RoundBF16(torch.autograd.Function):
    """Identity up to bf16 rounding, forward and backward."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(grad.dtype)


def _round_output(module, args, out):
    if torch.is_tensor(out) and out.is_floating_point():
        return _RoundBF16.apply(out)
    if isinstance(out, tuple):
        return tuple(_RoundBF16.apply(o) if torch.is_tensor(o) and o.is_floating_point() else o for o in out)
    return None


@pytest.fixture(scope="module")
def bf16_weights(tiny_qwen3, tmp_path_factory):
    """The test checkpoint with every weight rounded to bf16 (stored in fp32)."""
    _, model = tiny_qwen3
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    path = tmp_path_factory.mktemp("qwen3-bf16-weights")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fp32_reference(bf16_weights):
    """One step of the plain fp32 learner on the CPU (weights before and after, gradients, log-probs), and
    each gradient's allowed relative L2 error: 4x that of the bf16-rounding emulation, at least 5%."""
    ref = make(bf16_weights, torch.device("cpu"), fsdp=False)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    logp = ref._logprobs(ref.model, ragged_batch())
    ref.step(on_policy(ragged_batch(), logp))
    grads = ref.named_grads()
    emulated = AutoModelForCausalLM.from_pretrained(bf16_weights, dtype=torch.float64)
    for module in emulated.modules():
        if module is not emulated and not isinstance(module, nn.ModuleList):
            module.register_forward_hook(_round_output)
    emu = make(emulated, torch.device("cpu"), fsdp=False)
    emu.step(on_policy(ragged_batch(), logp))
    bounds = {name: max(0.05, 4 * _rel(g, grads[name])) for name, g in emu.named_grads().items()}
    return before, grads, ref.state_dict(), logp, bounds


@pytest.mark.parametrize("kw", [{"fsdp": True}, {"fsdp": False}, {"fsdp": True, "offload": True}],
                         ids=["fsdp2", "autocast", "fsdp2-offload"])
def test_bf16_update_matches_fp32_to_bf16_accuracy(bf16_weights, fp32_reference, kw):
    before, grads32, after32, logp32, bounds = fp32_reference
    assert bounds.keys() == grads32.keys() and max(bounds.values()) < 0.6  # the emulation itself is bf16-close
    learner = make(bf16_weights, CUDA, **kw)
    b = on_policy(ragged_batch(), logp32)
    mask = b.response_mask.bool()
    logp = learner._logprobs(learner.model, b.to(CUDA)).cpu()
    assert float((logp - logp32)[mask].abs().max()) < 0.1
    learner.step(b)
    grads = learner.named_grads()
    assert grads.keys() == grads32.keys()
    errors = {name: _rel(g, grads32[name]) for name, g in grads.items()}
    assert all(errors[name] < bounds[name] for name in errors), {n: (e, bounds[n]) for n, e in errors.items()}
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
    b = on_policy(b, lp_padded)
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
