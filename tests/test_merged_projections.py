"""Merged q|k|v and gate|up projections (`engine.merge_projections`): the merged engine computes what the
unmerged one does (the reference: seven separate linears, the decoder as built from the checkpoint),
loads the same Hugging Face names in place, and round-trips its own state."""

import pytest
import torch
from torch import nn

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.fp8_linear import FP8Linear
from kv4rl.engine.llm import Engine
from kv4rl.engine.merged_linears import LinearPart, MergedLinear, merge_linears
from kv4rl.engine.sequence import SamplingParams
from kv4rl.models.args import ModelArgs
from kv4rl.models.checkpoint_slots import CheckpointSlot
from kv4rl.models.decoder import Decoder
from tests.conftest import make_checkpoint

PROMPTS, FORCED = [[5, 6, 7], [11, 12, 1, 2]], [[8, 9, 10, 11], [13, 14, 15]]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def ckpt(request, tmp_path_factory):
    """Qwen3 (q/k norm) and Qwen2 (q/k/v bias); returns (folder, HF state dict)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, model_type=request.param)
    assert (request.param == "qwen2") == (hf.model.layers[0].self_attn.q_proj.bias is not None)
    return path, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _engine(path, merge: bool, weight_format: str = "auto") -> Engine:
    cfg = EngineConfig(kv=KVConfig(format="fp32"), max_model_len=64, merge_projections=merge,
                       weight_format=weight_format)
    return Engine(path, cfg, device="cpu", dtype="float32", max_num_seqs=2)


def _perturbed(state: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _assert_same_outputs(merged: Engine, plain: Engine, greedy: bool = False) -> torch.Tensor:
    """Teacher-forced logits agree (and greedy tokens, when asked); returns the merged engine's first."""
    got = merged.score_tokens(PROMPTS, FORCED)
    for a, b in zip(got, plain.score_tokens(PROMPTS, FORCED)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if greedy:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [c.token_ids for c in merged.generate(PROMPTS, params)] == [
            c.token_ids for c in plain.generate(PROMPTS, params)]
    return got[0]


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ---- the module ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "fp8"])
def test_merged_linear_and_its_parts_compute_the_separate_linears(kind):
    torch.manual_seed(0)
    plain = [nn.Linear(32, n, bias=True) for n in (48, 16, 16)]
    parts = plain if kind == "linear" else [FP8Linear.from_linear(p) for p in plain]
    x = torch.randn(5, 32)
    want = [p(x) for p in parts]
    merged = merge_linears(dict(zip("qkv", parts)))
    assert merged.sizes == (48, 16, 16) and merged.names == ("q", "k", "v")
    assert type(merged.linear) is type(parts[0])
    views = [LinearPart(merged, i) for i in range(3)]
    for got, part, w in zip(merged(x), views, want):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(part(x), w, rtol=1e-6, atol=1e-6)
    assert list(dict(views[0].named_parameters())) == [] and list(views[0].children()) == []
    with pytest.raises(TypeError, match="all nn.Linear or all FP8Linear"):
        merge_linears({"a": plain[0], "b": FP8Linear.from_linear(plain[1])})
    with pytest.raises(ValueError, match="with and without bias"):
        merge_linears({"a": nn.Linear(32, 8), "b": nn.Linear(32, 8, bias=False)})


def test_hf_targets_skip_modules_nested_in_a_slot_owner():
    """A module answering `checkpoint_slots()` stands for everything under it, even a child that answers
    too (an FP8Linear inside a merged linear): only the owner's names appear."""
    args = ModelArgs.from_hf_config({"model_type": "qwen3", "vocab_size": 11, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "head_dim": 8, "eos_token_id": 1})
    model = Decoder(args)
    loaded = []

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = FP8Linear(16, 16, bias=True)  # has checkpoint_slots of its own

        def checkpoint_slots(self):
            return {"packed": CheckpointSlot((3,), loaded.append)}

    model.model.layers[0].mlp.extra = Owner()
    names = set(model.hf_targets())
    assert "model.layers.0.mlp.extra.packed" in names
    assert not any(n.startswith("model.layers.0.mlp.extra.inner") for n in names)
    model.load_hf_state_dict({"model.layers.0.mlp.extra.packed": torch.ones(3)}, strict=False)
    assert len(loaded) == 1 and torch.equal(loaded[0], torch.ones(3))


# ---- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_format", ["auto", "fp8"])
def test_merged_engine_equals_unmerged(ckpt, weight_format):
    """Logits (and greedy tokens) from the checkpoint, then after the learner's refresh: streamed into the
    merged engine, a state dict into the reference (tests/test_weight_sync.py: stream = state dict)."""
    path, state = ckpt
    merged, plain = _engine(path, True, weight_format), _engine(path, False, weight_format)
    assert merged.plan.merge_projections.value and not plain.plan.merge_projections.value
    assert "merged q|k|v and gate|up" in merged.summary and "merged" not in plain.summary
    assert "merge_projections=True" in merged.plan.explain()
    attn = merged.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, MergedLinear) and isinstance(attn.q_proj, LinearPart)
    assert merged.model.hf_targets().keys() == plain.model.hf_targets().keys()
    before = _assert_same_outputs(merged, plain, greedy=weight_format == "auto")
    pointers = {n: t.data_ptr() for n, t in merged.model.state_dict(keep_vars=True).items()}
    new = _perturbed(state, seed=1)
    merged.load_weights(iter(new.items()), version=1)
    plain.load_weights(new, version=1)
    assert {n: t.data_ptr() for n, t in merged.model.state_dict(keep_vars=True).items()} == pointers
    assert not torch.allclose(_assert_same_outputs(merged, plain), before)  # the refresh arrived


def test_fp8_merged_codes_and_scales_are_the_unmerged_ones(ckpt):
    """Concatenating per-output-channel codes and scales is exact, at start and when a bf16 refresh
    re-quantizes into the merged rows."""
    path, state = ckpt
    merged, plain = _engine(path, True, "fp8"), _engine(path, False, "fp8")

    def check():
        for m, p in zip(merged.model.model.layers, plain.model.model.layers):
            for group, owner, names in ((m.self_attn.qkv_proj, p.self_attn, ("q_proj", "k_proj", "v_proj")),
                                        (m.mlp.gate_up_proj, p.mlp, ("gate_proj", "up_proj"))):
                parts = [getattr(owner, n) for n in names]
                assert isinstance(group.linear, FP8Linear)
                for field in ("qweight", "weight_scale", "bias"):
                    want = [getattr(q, field) for q in parts]
                    if want[0] is None:
                        assert group.linear.bias is None
                        continue
                    assert torch.equal(_codes(getattr(group.linear, field)), _codes(torch.cat(want))), field

    check()
    new = {k: v.bfloat16() for k, v in _perturbed(state, seed=3).items()}
    merged.load_weights(new, version=1)
    plain.load_weights(new, version=1)
    check()


@pytest.mark.parametrize("weight_format", ["auto", "fp8"])
def test_weights_state_is_the_unmerged_layout_and_round_trips(ckpt, weight_format):
    """The model holds each weight once; `weights_state` (checkpoints, attribution) splits the merged
    tensors back into the unmerged engine's names and values exactly, so states load across the setting."""
    path, state = ckpt
    src, dst, plain = (_engine(path, m, weight_format) for m in (True, True, False))
    own = src.model.state_dict()
    assert not any(".q_proj." in n or ".gate_proj." in n for n in own)
    new = _perturbed(state, seed=4)
    src.load_weights(new, version=3)
    plain.load_weights(new, version=3)
    saved, want = src.weights_state(), plain.weights_state()
    assert saved.keys() == want.keys()
    assert sum(t.numel() for t in own.values()) == sum(t.numel() for t in want.values())
    for name in want:
        assert torch.equal(_codes(saved[name]), _codes(want[name])), name
    dst.load_weights_state(want, version=3)  # saved unmerged, restored merged
    for a, b in zip(dst.score_tokens(PROMPTS, FORCED), src.score_tokens(PROMPTS, FORCED)):
        assert torch.equal(a, b)
    restored = _engine(path, False, weight_format)
    restored.load_weights_state(saved, version=3)  # and the other way
    for a, b in zip(restored.score_tokens(PROMPTS, FORCED), plain.score_tokens(PROMPTS, FORCED)):
        assert torch.equal(a, b)


def test_a_wrong_shape_for_a_merged_part_is_refused_before_copying(ckpt):
    path, state = ckpt
    engine = _engine(path, True)
    weight = engine.model.model.layers[0].self_attn.qkv_proj.linear.weight
    kept = weight.clone()
    bad = {k: v * 2 for k, v in state.items()}
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(64, 64\), expected \(32, 64\)"):
        engine.load_weights(bad, version=1)
    assert torch.equal(weight, kept)


@pytest.mark.parametrize("fp8", [False, True], ids=["linear", "fp8"])
def test_tensor_parallel_shards_load_their_slices_into_the_merged_rows(fp8):
    """A TP2 shard's HF-name slots (a slice of the full tensor each) land in its merged rows exactly as in
    the unmerged shard (the gloo run: tests/test_tensor_parallel.py)."""
    from kv4rl.engine.fp8_weights import apply_fp8_weights
    from kv4rl.engine.merged_linears import merge_projections
    from kv4rl.models.tensor_parallel import TensorParallel

    args = ModelArgs.from_hf_config({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 32,
                                     "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "head_dim": 8, "eos_token_id": 1})
    torch.manual_seed(0)
    full = {k: torch.randn(v.shape) for k, v in Decoder(args).state_dict().items()}
    for rank in range(2):
        shards = []
        for merge in (False, True):
            shard = Decoder(args, tp=TensorParallel(rank, 2))
            if fp8:
                apply_fp8_weights(shard)
            if merge:
                merge_projections(shard)
            shard.load_hf_state_dict(full)
            shards.append(shard)
        plain, merged = (s.model.layers[0] for s in shards)
        for group, owner, names in ((merged.self_attn.qkv_proj, plain.self_attn, ("q_proj", "k_proj", "v_proj")),
                                    (merged.mlp.gate_up_proj, plain.mlp, ("gate_proj", "up_proj"))):
            for field in ("qweight", "weight_scale", "bias") if fp8 else ("weight", "bias"):
                want = [getattr(getattr(owner, n), field) for n in names]
                if want[0] is None:
                    continue
                assert torch.equal(_codes(getattr(group.linear, field)), _codes(torch.cat(want))), (rank, field)
        q_rows = merged.self_attn.qkv_proj.sizes[0]
        assert q_rows == 16  # half of 4 heads x 8
        rows = full["model.layers.0.self_attn.q_proj.weight"].chunk(2)[rank]
        if not fp8:
            assert torch.equal(merged.self_attn.qkv_proj.linear.weight[:q_rows], rows)
