"""The engine's decoder against ``transformers`` on tiny random checkpoints.

Reference: ``AutoModelForCausalLM`` (eager attention) loaded from the same folder. The engine gets a
plain dense causal attention callable built on SDPA, so any mismatch comes from the model code or
the loader. Weights use a wide init and perturbed norms/biases so that a wrong norm, bias, RoPE or
head mapping moves the log-probs far beyond the 1e-4 tolerance (checked by a sensitivity test).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from kv4rl.models import Decoder, ModelArgs, ModelFolderError, check_model_folder, load_model
from kv4rl.models.layers import rope_inv_freq

TOL = 1e-4
SIZES = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that the high, blended and stretched frequency bands all occur at head_dim 16.
    "original_max_position_embeddings": 64,
}
CASES = {
    "qwen3": (Qwen3Config, {}),
    "qwen3_tied": (Qwen3Config, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, {}),
    "qwen2_tied": (Qwen2Config, {"tie_word_embeddings": True}),
    "llama": (LlamaConfig, {}),
    "llama_bias": (LlamaConfig, {"attention_bias": True}),
    "llama3_rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": (
        LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
    ),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "mistral_window_past_context": (MistralConfig, {"sliding_window": 4096}),  # 4096 >= 128 positions: no effect
}


def make_hf_model(case: str, seed: int = 0):
    config_cls, extra = CASES[case]
    sizes = dict(SIZES)
    if config_cls is Qwen2Config:
        sizes.pop("head_dim")
    config = config_cls(**sizes, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (folder, HF model reloaded from it)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            folder = tmp_path_factory.mktemp(case)
            make_hf_model(case).save_pretrained(folder)
            cache[case] = (folder, load_reference(folder))
        return cache[case]

    return get


def load_reference(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def repeat_kv(q, k, v):
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def dense_causal_attention(layer_idx, q, k, v):
    """One sequence: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
    k, v = repeat_kv(q, k, v)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def varlen_attention(seq_lens):
    """Several sequences flattened one after another: causal within each, blind across."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    index = torch.arange(len(seq_of_token))
    allowed = (seq_of_token[:, None] == seq_of_token[None, :]) & (index[:, None] >= index[None, :])

    def attention(layer_idx, q, k, v):
        k, v = repeat_kv(q, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed
        )
        return out.transpose(0, 1)

    return attention


@torch.no_grad()
def engine_logprobs(model: Decoder, ids, positions, attention):
    return torch.log_softmax(model.compute_logits(model(ids, positions, attention)), dim=-1)


@torch.no_grad()
def reference_logprobs(hf_model, ids):
    return torch.log_softmax(hf_model(ids[None]).logits[0].float(), dim=-1)


def token_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))


def single_sequence_gap(model, hf_model, length=24, seed=1, positions=None):
    ids = token_ids(length, seed)
    positions = torch.arange(length) if positions is None else positions
    ours = engine_logprobs(model, ids, positions, dense_causal_attention)
    return (ours - reference_logprobs(hf_model, ids)).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_single_sequence_logprobs_match_transformers(saved, case):
    folder, hf_model = saved(case)
    model, args = load_model(folder, device="cpu", dtype=torch.float32)
    assert args.model_type == hf_model.config.model_type
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == args.tie_word_embeddings
    reference = reference_logprobs(hf_model, token_ids(24, 1))
    # Non-trivial distributions, so the tolerance below actually discriminates.
    assert reference.std(dim=-1).min() > 0.3
    assert single_sequence_gap(model, hf_model) < TOL


@pytest.mark.parametrize("case", ["qwen3", "qwen2", "llama3_rope"])
def test_flattened_batch_matches_each_sequence(saved, case):
    folder, hf_model = saved(case)
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    seq_lens = [13, 21]
    sequences = [token_ids(n, seed=10 + i) for i, n in enumerate(seq_lens)]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    ours = engine_logprobs(model, ids, positions, varlen_attention(seq_lens))
    for ours_seq, seq in zip(ours.split(seq_lens), sequences, strict=True):
        assert (ours_seq - reference_logprobs(hf_model, seq)).abs().max().item() < TOL


def eager_like_attention(layer_idx, q, k, v):
    """The same operations as transformers' eager attention: fp32 softmax, additive causal mask."""
    k, v = repeat_kv(q, k, v)
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    length = q.shape[2]
    mask = torch.full((length, length), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)[0].transpose(0, 1)


@pytest.mark.parametrize("case", ["qwen3", "qwen2", "llama3_rope"])
def test_bf16_is_bitwise_equal_given_the_same_attention(saved, case):
    """Norms, RoPE, residuals and the head run the same bf16 ops as transformers, so with an
    attention callable that mirrors its eager path the log-probs agree exactly."""
    folder, _ = saved(case)
    model, _ = load_model(folder, device="cpu", dtype=torch.bfloat16)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager")
    ids = token_ids(24, seed=2)
    ours = engine_logprobs(model, ids, torch.arange(24), eager_like_attention)
    assert torch.equal(ours, reference_logprobs(hf_model.eval(), ids))


def test_parity_check_is_sensitive(saved):
    """RoPE only sees relative offsets: a constant shift keeps the match, stretched positions or
    dropping the llama3 scaling break it by far more than TOL."""
    folder, hf_model = saved("llama3_rope")
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    assert single_sequence_gap(model, hf_model, positions=torch.arange(24) + 5) < TOL
    assert single_sequence_gap(model, hf_model, positions=torch.arange(24) * 2) > 100 * TOL
    model.rotary.scaling = None
    model.rotary.build_cache()
    assert single_sequence_gap(model, hf_model) > 100 * TOL


def test_sharded_checkpoint(tmp_path):
    hf_model = make_hf_model("qwen3", seed=3)
    hf_model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert single_sequence_gap(model, load_reference(tmp_path)) < TOL


@pytest.mark.parametrize("case", ["qwen3", "qwen3_tied", "qwen2"])
def test_load_hf_state_dict_follows_updated_weights(saved, case):
    folder, _ = saved(case)
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    hf_model = make_hf_model(case)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    assert single_sequence_gap(model, hf_model) > 100 * TOL
    pointers = {name: p.data_ptr() for name, p in model.state_dict(keep_vars=True).items()}
    copied = model.load_hf_state_dict(hf_model.state_dict())
    assert copied == len(model.hf_targets())
    assert {name: p.data_ptr() for name, p in model.state_dict(keep_vars=True).items()} == pointers
    assert single_sequence_gap(model, hf_model) < TOL


def test_load_hf_state_dict_casts_and_validates(saved):
    folder, hf_model = saved("qwen3")
    model, _ = load_model(folder, device="cpu", dtype=torch.bfloat16)
    source = {name: torch.randn_like(t) for name, t in hf_model.state_dict().items()}
    model.load_hf_state_dict(source)
    name = "model.layers.1.self_attn.k_norm.weight"
    assert model.state_dict()[name].dtype == torch.bfloat16
    assert torch.equal(model.state_dict()[name], source[name].to(torch.bfloat16))
    before = model.state_dict()["model.norm.weight"].clone()
    partial = {"model.norm.weight": torch.zeros(SIZES["hidden_size"])}
    with pytest.raises(ValueError, match="missing parameters: model.embed_tokens.weight"):
        model.load_hf_state_dict(partial)
    assert torch.equal(model.state_dict()["model.norm.weight"], before)
    assert model.load_hf_state_dict(partial, strict=False) == 1
    assert torch.count_nonzero(model.state_dict()["model.norm.weight"]) == 0
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        model.load_hf_state_dict({"model.norm.weight": torch.zeros(3)}, strict=False)
    with pytest.raises(ValueError, match="model.layers.0.mystery"):
        model.load_hf_state_dict({"model.layers.0.mystery": torch.zeros(3)}, strict=False)


# ---- folder errors ---------------------------------------------------------------------------------


def copy_folder(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def rewrite_weights(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_folder_errors(saved, tmp_path):
    folder, _ = saved("llama")
    with pytest.raises(ModelFolderError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    no_config = copy_folder(folder, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="config.json is missing"):
        load_model(no_config)
    no_weights = copy_folder(folder, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match="no \\*.safetensors"):
        load_model(no_weights)


@pytest.mark.parametrize("generation, want", [
    (None, (3,)),  # no generation_config.json: config.json's id alone
    ({"eos_token_id": [7, 3]}, (3, 7)),  # config.json's ids first, each once
    ({"eos_token_id": 9}, (3, 9)),
    ({"eos_token_id": None, "temperature": 0.6}, (3,)),
    ({"do_sample": True}, (3,)),
])
def test_generation_config_adds_stop_ids(tmp_path, generation, want):
    from kv4rl.models.hf_weights import read_model_args

    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "eos_token_id": 3}
    (tmp_path / "config.json").write_text(json.dumps(base))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    args = read_model_args(tmp_path)
    assert args.eos_token_ids == want
    assert args == ModelArgs.from_hf_config({**base, "eos_token_id": list(want) if len(want) > 1 else want[0]})


@pytest.mark.parametrize("text, message", [("{", "generation_config.json: Expecting"),
                                           ("[1]", "expected a JSON object"),
                                           ('{"eos_token_id": "x"}', "eos_token_id must be")])
def test_a_bad_generation_config_is_named(tmp_path, text, message):
    from kv4rl.models.hf_weights import read_model_args

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "eos_token_id": 3}))
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ModelFolderError, match=message):
        read_model_args(tmp_path)


@pytest.mark.parametrize("keep", [0, 50, -100], ids=["empty", "cut_in_header", "cut_in_tensor_data"])
def test_a_truncated_weight_file_is_named(tmp_path, keep):
    """A copy cut short (an interrupted download or save), also after a header that parses: named as a
    ModelFolderError, which commands report in one line, not a safetensors traceback."""
    from kv4rl.models.tiny import tiny_model_dir

    folder = shutil.copytree(tiny_model_dir(progress=False), tmp_path / "model")
    weights = folder / "model.safetensors"
    os.truncate(weights, keep if keep >= 0 else weights.stat().st_size + keep)
    for check in (check_model_folder, load_model):
        with pytest.raises(ModelFolderError) as error:
            check(folder)
        message = str(error.value)
        assert message.startswith(f"{weights}: not a readable safetensors file (") and "\n" not in message
        assert message.endswith("is the copy complete?")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "missing parameters: model.layers.1.mlp.up_proj.weight",
        ),
        (lambda t: t.update({"model.norm.weight": torch.ones(65)}), "model.norm.weight has shape \\(65,\\)"),
        (
            lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}),
            "unexpected.*model.layers.0.extra.weight",
        ),
    ],
    ids=["missing", "wrong_shape", "unexpected"],
)
def test_bad_tensors_are_named(saved, tmp_path, edit, message):
    folder = copy_folder(saved("llama")[0], tmp_path / "bad")
    rewrite_weights(folder, edit)
    with pytest.raises(ModelFolderError, match=message):
        load_model(folder, dtype=torch.float32)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFolderError, match=message):
        check_model_folder(folder)


def test_harmless_extras_and_optional_tied_head(saved, tmp_path):
    folder, hf_model = saved("qwen2_tied")
    folder = copy_folder(folder, tmp_path / "extras")

    def add_extras(tensors):
        assert "lm_head.weight" not in tensors  # transformers drops the tied head when saving
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    rewrite_weights(folder, add_extras)
    model, _ = load_model(folder, dtype=torch.float32)
    assert single_sequence_gap(model, hf_model) < TOL


def test_untied_checkpoint_requires_lm_head(saved, tmp_path):
    folder = copy_folder(saved("qwen2")[0], tmp_path / "headless")
    rewrite_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelFolderError, match="missing parameters: lm_head.weight"):
        load_model(folder)


def test_check_model_folder(saved, tmp_path):
    folder = copy_folder(saved("qwen3")[0], tmp_path / "complete")
    with pytest.raises(ModelFolderError, match="no tokenizer files"):
        check_model_folder(folder)
    (folder / "vocab.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="no tokenizer files"):
        check_model_folder(folder)
    (folder / "merges.txt").write_text("")
    assert check_model_folder(folder).num_layers == SIZES["num_hidden_layers"]
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelFolderError, match="model-00002-of-00002.safetensors"):
        check_model_folder(folder)


def test_unsupported_configs_are_named(saved, tmp_path):
    config = json.loads((saved("llama")[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="'gemma'"):
        ModelArgs.from_hf_config({**config, "model_type": "gemma"})
    with pytest.raises(ValueError, match="'yarn'"):
        ModelArgs.from_hf_config({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    folder = copy_folder(saved("llama")[0], tmp_path / "gemma")
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ModelFolderError, match="'gemma'"):
        load_model(folder)


@pytest.mark.parametrize("window, refused", [(None, False), (128, False), (64, True), ("absent", True)])
def test_a_mistral_sliding_window_inside_the_context_is_refused(saved, window, refused):
    """transformers' Mistral attends within its window (4096 where config.json leaves the key out); the
    engine attends over the whole context, so only a window that covers every position is taken."""
    config = {**json.loads((saved("mistral")[0] / "config.json").read_text()), "sliding_window": window}
    if window == "absent":
        config = {**config, "max_position_embeddings": 8192}
        del config["sliding_window"]
    if refused:
        with pytest.raises(ValueError, match=r"mistral: sliding_window=\d+ below max_position_embeddings"):
            ModelArgs.from_hf_config(config)
    else:
        assert ModelArgs.from_hf_config(config).model_type == "mistral"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama", "mistral"])
@pytest.mark.parametrize("kv_heads", ["absent", None])
def test_kv_heads_left_out_or_null_default_as_transformers_does(model_type, kv_heads):
    """The engine took as many KV heads as query heads wherever config.json left the key out; transformers
    takes its family's default there (8 for Mistral, 32 for Qwen), so a loadable folder failed with wrong
    tensor shapes. Reference: the transformers config built from the same keys."""
    from transformers import AutoConfig

    config = {"model_type": model_type, **SIZES, "num_attention_heads": 32, "hidden_size": 512, "head_dim": 16}
    del config["num_key_value_heads"]
    if kv_heads is None:
        if model_type == "mistral":
            pytest.skip("transformers' MistralConfig refuses a null num_key_value_heads: the learner stops first")
        config["num_key_value_heads"] = None
    expected = AutoConfig.for_model(**config).num_key_value_heads
    assert ModelArgs.from_hf_config(config).num_kv_heads == expected


# ---- config parsing and RoPE maths ---------------------------------------------------------------


def test_old_and_new_rope_config_styles_agree():
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "eos_token_id": [3, 7],
    }
    old_style = ModelArgs.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new_style = ModelArgs.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    )
    assert old_style == new_style
    assert new_style.rope_theta == 5e5 and new_style.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert new_style.head_dim == 8 and new_style.num_kv_heads == 4 and new_style.eos_token_ids == (3, 7)
    plain = ModelArgs.from_hf_config({**base, "rope_theta": 1e6, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    qwen2 = ModelArgs.from_hf_config({**base, "model_type": "qwen2", "attention_bias": False, "num_key_value_heads": 4})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm


_LLAMA3_NO_CONTEXT = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_theta", "original_max_position_embeddings")}


@pytest.mark.parametrize("rope", [
    # a transformers-5 checkpoint (rope_parameters) to which a user added an old-style rope_scaling
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 5e5,
     "rope_scaling": {"rope_type": "llama3", "rope_theta": 300.0, **_LLAMA3_NO_CONTEXT, "original_max_position_embeddings": 32}},
    # rope_theta inside an old-style rope_scaling and at the top level
    {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 50.0}},
    {"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    # llama3's pretraining length at the top level and in the dict, old and new style
    {"rope_theta": 5e5, "original_max_position_embeddings": 128,
     "rope_scaling": {"rope_type": "llama3", **_LLAMA3_NO_CONTEXT, "original_max_position_embeddings": 32}},
    {"original_max_position_embeddings": 128,
     "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **_LLAMA3_NO_CONTEXT, "original_max_position_embeddings": 32}},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **_LLAMA3_NO_CONTEXT}},
], ids=["scaling-over-parameters", "scaling-over-parameters-llama3", "theta-in-scaling", "theta-in-parameters",
        "llama3-context-twice-old", "llama3-context-twice-new", "llama3-context-from-max"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_rope_set_twice_rotates_as_transformers_model_does(rope, model_type, tmp_path):
    """Where a config.json sets a RoPE value twice the engine took the other one than transformers' model (the
    learner's), silently: log-probs 1-3 nats apart (QA). The reference is the model transformers builds from the
    same file, its rotary embedding's frequencies (its config object can still show the other value)."""
    from transformers import AutoConfig

    config = {"model_type": model_type, **SIZES, "num_hidden_layers": 1, **rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_rotary = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).model.rotary_emb
    args = ModelArgs.from_hf_config(config)
    ours = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours.double(), hf_rotary.inv_freq.double(), rtol=1e-6, atol=0)
    assert getattr(hf_rotary, "attention_scaling", 1.0) == 1.0  # the scaled types the engine runs leave it at 1


def test_partial_rotary_factor_is_refused_where_it_is_set():
    """A top-level one was ignored at the start (as transformers' default RoPE does) and then refused at the
    first resume: transformers moves it into the rope dict when it saves the run's checkpoint."""
    config = {"model_type": "llama", **SIZES}
    for rope in ({"partial_rotary_factor": 0.5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 0.5}}):
        with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
            ModelArgs.from_hf_config({**config, **rope})
    assert ModelArgs.from_hf_config({**config, "partial_rotary_factor": 1.0}).rope_scaling is None


def test_llama3_inv_freq_against_float64_definition():
    head_dim, theta = 16, 10000.0
    ours = rope_inv_freq(head_dim, theta, LLAMA3_ROPE)
    factor, low, high = LLAMA3_ROPE["factor"], LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    context = LLAMA3_ROPE["original_max_position_embeddings"]
    bands = set()
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            expected, band = freq, "kept"
        elif wavelength > context / low:
            expected, band = freq / factor, "stretched"
        else:
            blend = (context / wavelength - low) / (high - low)
            expected, band = (1 - blend) * freq / factor + blend * freq, "blended"
        bands.add(band)
        assert ours[i].item() == pytest.approx(expected, rel=1e-6)
    assert bands == {"kept", "stretched", "blended"}


def test_a_tied_config_over_a_different_head_in_the_file_is_refused(tmp_path):
    """The engine took the embedding as the head, transformers untied them and took the file's: a run trained
    with a learner-engine mismatch of ~6.8 nats per token and no warning. A head equal to the embedding is fine."""
    import json

    from safetensors.torch import load_file, save_file

    from kv4rl.models.tiny import tiny_model_dir

    folder = shutil.copytree(tiny_model_dir(progress=False), tmp_path / "model")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    weights = load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embed.clone()}, folder / "model.safetensors", metadata={"format": "pt"})
    check_model_folder(folder)  # the same tensor written twice: what some exports do
    head = embed.clone()
    head[-1, 0] += 1.0  # one value in the last row
    save_file({**weights, "lm_head.weight": head}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match="ties the embeddings .* holds? an lm_head.weight that differs"):
        check_model_folder(folder)
