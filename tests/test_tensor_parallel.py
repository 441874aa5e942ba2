"""Tensor-parallel engine on the CPU (gloo, two processes): a TP2 engine equals the TP1 engine.

The reference is the unsharded engine in this process, on the same checkpoint, with seven separate
projections per layer (the shards merge q|k|v and gate|up, the default): teacher-forced logits
agree to float32 rounding (the sharded o_proj/down_proj sum their halves in another order), and
sampled tokens are equal, for every KV format (each rank holds half the KV heads in that format).
"""

from __future__ import annotations

import pytest
import torch

from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from kv4rl.models.args import ModelArgs
from kv4rl.models.tensor_parallel import check_shardable, shard_args, split_rule
from tests.conftest import make_checkpoint
from tests.gloo_ranks import run_on_gloo_ranks

FORMATS = ["fp32", "bf16", "fp8", "int4", "kv4", "nvfp4", "mxfp4"]
PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
FORCED = [[4, 8, 15, 16, 23, 42], [7, 7, 7], [60, 61, 62, 63]]


def _engine(path, fmt: str, tp: int, merge: bool = True) -> Engine:
    kv = KVConfig(format=fmt, group_size=32, n_sink=2, n_recent=4)
    return Engine(path, EngineConfig(kv=kv, max_model_len=64, tensor_parallel=tp, merge_projections=merge),
                  device="cpu", dtype="float32", max_num_seqs=4)


def _results(path, tp: int, merge: bool = True) -> dict:
    out = {}
    for fmt in FORMATS:
        engine = _engine(path, fmt, tp, merge)
        assert engine.plan.merge_projections.value is merge
        logits = engine.score_tokens(PROMPTS, FORCED)
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
        tokens = [c.token_ids for c in engine.generate(PROMPTS, params)]
        out[fmt] = {"logits": logits, "tokens": tokens, "kv_heads": engine.args.num_kv_heads}
    return out


def _tp2_results(rank: int, path: str) -> dict:
    return _results(path, tp=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-qwen3")
    make_checkpoint(path, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return path


def test_tp2_engine_equals_tp1_for_every_kv_format(checkpoint, tmp_path):
    expected = _results(checkpoint, tp=1, merge=False)
    for rank, got in enumerate(run_on_gloo_ranks(_tp2_results, 2, tmp_path, str(checkpoint))):
        for fmt in FORMATS:
            assert got[fmt]["kv_heads"] == 1, "each rank holds half of the 2 KV heads"
            for want, have in zip(expected[fmt]["logits"], got[fmt]["logits"]):
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-4, msg=f"{fmt} rank {rank}")
            assert got[fmt]["tokens"] == expected[fmt]["tokens"], f"{fmt} rank {rank}"


def _args(**over) -> ModelArgs:
    base = {"model_type": "qwen3", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 32, "eos_token_id": None}
    return ModelArgs.from_hf_config({**base, **over})


def test_shard_shapes_and_split_rules():
    local = shard_args(_args(), 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 1, 48)
    assert split_rule("model.layers.3.self_attn.q_proj.weight") == ("column", 0)
    assert split_rule("model.layers.0.mlp.down_proj.weight") == ("row", 1)
    assert split_rule("model.layers.0.self_attn.o_proj.bias") == ("row", -1)
    assert split_rule("model.layers.0.self_attn.q_norm.weight") is None
    assert split_rule("lm_head.weight") is None and split_rule("model.embed_tokens.weight") is None


@pytest.mark.parametrize("size, what", [(4, "KV heads"), (3, "attention heads"), (0, ">= 1")])
def test_unshardable_sizes_are_refused_by_name(size, what):
    with pytest.raises(ValueError, match=what):
        check_shardable(_args(), size)


def test_tensor_parallel_without_torchrun_says_how_to_start(checkpoint):
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        _engine(checkpoint, "fp32", tp=2)


def test_train_refuses_tensor_parallel_without_torchrun_and_an_unshardable_model_before_the_learner(
        tmp_path, monkeypatch):
    """Without torchrun the message spoke of "the 1 ranks torchrun started"; a model whose heads the ranks
    cannot split was refused only once the engine was built, after the learner (minutes at 8B)."""
    import kv4rl.loop as loop
    from kv4rl.config import ConfigError, load_config
    from kv4rl.distributed import Ranks
    from tests.conftest import make_checkpoint

    small = ["device=cpu", "rollout.quota_groups=2", "rollout.group_size=2", f"out_dir={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel=2 needs 2 processes: start with "
                                          r"`torchrun --nproc-per-node 2 -m kv4rl.cli train"):
        loop.train(load_config(None, [*small, "engine.tensor_parallel=2"]), show_progress=False)
    from kv4rl.data.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(tmp_path / "one-kv-head")
    make_checkpoint(tmp_path / "one-kv-head", vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    num_key_value_heads=1)
    monkeypatch.setattr(loop, "current", lambda: Ranks(0, 2))  # as rank 0 of two
    monkeypatch.setattr(loop, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(loop, "build_learner", lambda *a, **k: pytest.fail("the learner was built"))
    with pytest.raises(ConfigError, match="engine.tensor_parallel=2 does not divide the model's 1 KV heads"):
        loop.train(load_config(None, [*small, "engine.tensor_parallel=2", f"model.path={tmp_path / 'one-kv-head'}"]),
                   show_progress=False)
    assert not (tmp_path / "runs").exists()


def test_a_tensor_parallel_resume_refuses_an_older_checkpoint_holding_one_ranks_slice(tmp_path):
    """Checkpoints written before each rank saved its own slice hold rank 0's: loading it on every rank is
    the wrong-weights resume that per-rank files fixed, so such a checkpoint is refused by name."""
    from types import SimpleNamespace

    from kv4rl.run_checkpoint import restore_state

    loaded = []
    s = SimpleNamespace(learner=SimpleNamespace(load_checkpoint_state=lambda state, path: None),
                        engine=SimpleNamespace(tp=SimpleNamespace(size=2), load_weights_state=loaded.append))
    state = {"iteration": 3, "optimizer": {}, "engine_weights": {"w": torch.zeros(1)}, "engine_version": 2}
    with pytest.raises(ValueError, match="holds one rank's slice of the lagging tensor-parallel engine's weights"):
        restore_state(s, state, tmp_path)
    assert loaded == []
