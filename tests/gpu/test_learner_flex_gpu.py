"""Packed micro-batches through FlexAttention on CUDA against padded rows through SDPA.

Expected: in fp32 the packed flex forward and backward give the padded log-probs and gradients to
kernel rounding (a leak across sequences or a wrong block would be off by orders of magnitude
more); the bf16 FSDP2 learner picks flex for packed rows by itself (`trainer.attention: auto`) and
matches the padded SDPA learner to bf16 accuracy over micro-batches of different lengths (each new
length a new shape for the compiled kernel) and over two updates.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.logprobs import token_logprobs
from kv4rl.trainer.attention import document_block_mask, set_attention
from kv4rl.trainer.packing import pack_rows
from tests.gpu.test_learner_gpu import _rel, make, on_policy, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _logprobs_and_grads(model, batch, packed: bool):
    model.zero_grad(set_to_none=True)
    if packed:  # the learner's own path: the packed row with the block mask built from the lengths
        rows = pack_rows(batch.input_ids, batch.attention_mask)
        mask = document_block_mask(batch.attention_mask.sum(1))
        logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=mask).logits[:, :-1]
        logp = rows.unpack(token_logprobs(logits, rows.input_ids[:, 1:], 1.0))
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logp = token_logprobs(logits, batch.input_ids[:, 1:], 1.0)
    (logp * batch.advantages * batch.response_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fp32_packed_flex_equals_padded_sdpa(tiny_qwen3):
    path, _ = tiny_qwen3
    batch = ragged_batch().to(CUDA)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(CUDA).train()
    model.config.use_cache = False
    lp_padded, g_padded = _logprobs_and_grads(model, batch, packed=False)
    set_attention(model, "flex")
    lp_flex, g_flex = _logprobs_and_grads(model, batch, packed=True)
    real = batch.attention_mask[:, 1:].bool()
    assert (lp_flex[~real] == 0).all()
    assert float((lp_flex - lp_padded)[real].abs().max()) < 2e-3
    assert g_flex.keys() == g_padded.keys()
    for name, g in g_padded.items():
        assert _rel(g_flex[name], g) < 5e-3, name


def test_bf16_learner_packs_with_flex_and_matches_padded_sdpa(tiny_qwen3):
    path, _ = tiny_qwen3
    b = ragged_batch().to(CUDA)
    mask = b.response_mask.bool()
    padded, flex = make(path, CUDA), make(path, CUDA, max_tokens_per_micro_batch=256)
    assert (padded.attention, flex.attention) == ("sdpa", "flex")  # trainer.attention: auto
    assert flex.model.config._attn_implementation == "flex_attention"
    lengths = {int(b.attention_mask[rows].sum()) for rows in flex.micro_batches(b, torch.arange(len(b), device=CUDA))}
    assert len(lengths) > 1  # packed rows of several lengths
    lp_padded, lp_flex = padded._logprobs(padded.model, b), flex._logprobs(flex.model, b)
    assert float((lp_flex - lp_padded)[mask].abs().max()) < 0.1
    b = on_policy(b, lp_padded)
    # Update 0 starts from the same weights, so the two differ only by the kernels' bf16 rounding: 5% on
    # every gradient. Adam's first step moves every weight by about ±lr whatever the gradient's size, so
    # where a gradient element is near 0 the two learners step in opposite directions; update 1's
    # per-parameter gradients then differ by more than rounding (the H200 measured 5.2% and, another
    # day, 32% on the embedding, 2026-12-01) and only its totals are compared. Exactness is the fp32
    # test's job above.
    for update, bound in enumerate((0.05, 0.10)):
        m_padded, m_flex = padded.step(b), flex.step(b)
        assert m_flex["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=bound), update
        assert m_flex["loss"] == pytest.approx(m_padded["loss"], rel=bound, abs=1e-3), update
        if update == 0:
            grads = flex.named_grads()
            for name, g in padded.named_grads().items():
                assert _rel(grads[name], g) < bound, (update, name)
