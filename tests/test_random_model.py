"""Random-init models of real Qwen3 shapes, built in memory, and engines around them."""

import pytest
import torch

from kv4rl.bench.random_model import QWEN3_SHAPES, decoder_from_hf, qwen3_args, random_decoder
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from kv4rl.models.decoder import Decoder
from tests.conftest import assert_plain_modes
from tests.test_engine import greedy_reference, prompts

# "Number of Parameters (Non-Embedding)" on the Qwen3 model cards, in billions (rounded as published)
CARD_NON_EMBEDDING = {"qwen3-0.6b": 0.44, "qwen3-1.7b": 1.4, "qwen3-4b": 3.6, "qwen3-8b": 6.95}


@pytest.mark.parametrize("shape", sorted(QWEN3_SHAPES))
def test_shapes_have_the_published_parameter_counts(shape):
    with torch.device("meta"):
        model = Decoder(qwen3_args(shape))
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    digits = len(str(CARD_NON_EMBEDDING[shape]).split(".")[1])
    assert round(non_embedding / 1e9, digits) == CARD_NON_EMBEDDING[shape]


def test_random_decoder_is_seeded_and_initialised_like_transformers():
    a = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32, seed=3)
    b = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32, seed=3)
    c = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, as the shape says
    for name, p in sa.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.float().std().item() - 0.02) < 0.003 and abs(p.float().mean().item()) < 0.002, name
    assert a.model.embed_tokens.weight.dtype == torch.float32
    assert random_decoder("qwen3-tiny", "cpu", num_layers=1).model.embed_tokens.weight.dtype == torch.bfloat16


def test_random_decoder_computes_what_transformers_computes_with_its_weights():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kv4rl.bench.random_model import TEST_SHAPES

    model = random_decoder("qwen3-tiny", "cpu", dtype=torch.float32, seed=1)
    hf = Qwen3ForCausalLM(Qwen3Config(**TEST_SHAPES["qwen3-tiny"])).eval()
    hf.load_state_dict(model.state_dict(), strict=False)  # the decoder lacks only non-persistent buffers
    engine = Engine.from_model(model, EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64), max_num_seqs=4)
    ps = prompts(4, 1024, seed=2)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, c in zip(ps, outs):
        assert c.token_ids == greedy_reference(hf, p, 8)


def test_engine_from_an_in_memory_copy_of_a_transformers_model(tiny_qwen3):
    _, hf = tiny_qwen3
    engine = Engine.from_model(decoder_from_hf(hf), EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64),
                               max_num_seqs=3)
    assert engine.device.type == "cpu" and engine.dtype == torch.float32
    ps = prompts(5, 97, seed=4)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, c in zip(ps, outs):
        assert c.token_ids == greedy_reference(hf, p, 10)


def test_engine_takes_a_folder_or_a_model_not_both(tiny_qwen3):
    path, hf = tiny_qwen3
    with pytest.raises(ValueError, match="exactly one"):
        Engine(path, model=decoder_from_hf(hf))
    with pytest.raises(ValueError, match="exactly one"):
        Engine(None)
    with pytest.raises(ValueError, match="device and dtype"):
        Engine.from_model(decoder_from_hf(hf), device="cpu")


def test_random_model_folders_are_cached_by_shape_seed_and_device(tmp_path):
    """Built once, then returned as is; weights drawn on a GPU are not the CPU's, so they are cached apart."""
    from safetensors.torch import load_file

    from kv4rl.bench.random_model import random_model_dir

    folder = random_model_dir("qwen3-tiny", seed=3, cache_dir=tmp_path)
    assert folder.name == "random-qwen3-tiny-L2-seed3"
    weights = load_file(folder / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert random_model_dir("qwen3-tiny", seed=3, cache_dir=tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    if torch.cuda.is_available():
        on_gpu = random_model_dir("qwen3-tiny", seed=3, cache_dir=tmp_path, device="cuda")
        assert on_gpu.name == "random-qwen3-tiny-L2-seed3-cuda"
        gpu_weights = load_file(on_gpu / "model.safetensors")
        assert set(gpu_weights) == set(weights)
        assert all(w.dtype == torch.bfloat16 and w.shape == weights[n].shape for n, w in gpu_weights.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["random-qwen3-tiny-L2-seed3"] + (["random-qwen3-tiny-L2-seed3-cuda"] if torch.cuda.is_available() else []))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert_plain_modes(folder, scratch)  # not the private ones of mkdtemp and safetensors
