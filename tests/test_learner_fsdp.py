"""FSDP2 learner at world size 1 on CPU: the same update as a plain module, plain weights out,
a Hugging Face folder transformers loads, and an optimizer state that resumes exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner, check_learner_options


def ragged_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], [[0] * len(r) for r in responses],
                       [1.0, -0.5, 0.3, -0.8], pad_id=0)


def make(path, fsdp, ref=None, **kw):
    kw = {"algo": AlgoConfig(), **kw}
    return Learner(path, ref, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), grad_clip=1.0,
                   micro_batch_size=2, updates_per_batch=2, temperature=1.0, device=torch.device("cpu"),
                   fsdp=fsdp, **kw)


def test_fsdp_and_plain_learners_take_the_same_steps(tiny_qwen3):
    path, _ = tiny_qwen3
    plain, sharded = make(path, False), make(path, True)
    assert type(sharded.model).__name__.startswith("FSDP") and not type(plain.model).__name__.startswith("FSDP")
    for seed in (0, 1):
        m_plain, m_sharded = plain.step(ragged_batch(seed)), sharded.step(ragged_batch(seed))
        assert m_sharded["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    w_plain, w_sharded = plain.state_dict(), sharded.state_dict()
    assert w_plain.keys() == w_sharded.keys()
    for name, w in w_sharded.items():
        assert type(w) is torch.Tensor, name  # plain tensors for the engine, not DTensors
        torch.testing.assert_close(w, w_plain[name], rtol=0, atol=1e-6, msg=name)


def test_save_pretrained_writes_a_folder_transformers_loads(tiny_qwen3, tmp_path):
    path, _ = tiny_qwen3
    learner = make(path, True)
    learner.step(ragged_batch())
    learner.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert loaded.config.architectures == ["Qwen3ForCausalLM"]
    # the learner trains without a KV cache; the saved model's forward returned none (use_cache: false)
    assert loaded.config.use_cache is True
    assert loaded(torch.tensor([[1, 2, 3]])).past_key_values is not None
    weights = learner.state_dict()
    for name, w in loaded.state_dict().items():
        assert torch.equal(w, weights[name]), name


def test_a_tied_head_gathered_as_its_own_copy_is_not_saved_twice(tmp_path):
    """Gathered from two ranks' shards, lm_head.weight and the embedding are separate tensors, and the tied
    head was saved beside the embedding (as a one-process save, with shared storage, never was)."""
    from safetensors import safe_open

    from tests.conftest import make_checkpoint

    path = tmp_path / "tied"
    make_checkpoint(path, tie_word_embeddings=True)
    learner = make(path, True)
    state = {k: v.detach().cpu().clone() for k, v in learner.state_dict().items()}  # every tensor its own
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    learner.save_pretrained(tmp_path / "out", state=state)
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("legacy", [False, True])
def test_optimizer_state_resumes_bit_identically(tiny_qwen3, legacy):
    """Two steps in one learner == one step, checkpoint, a fresh learner loading it, one step. `legacy`:
    the checkpoint holds `optimizer.state_dict()` of a plain learner (index-keyed, older runs)."""
    path, _ = tiny_qwen3
    straight = make(path, True)
    straight.step(ragged_batch(0))
    straight.step(ragged_batch(1))
    first = make(path, not legacy)
    first.step(ragged_batch(0))
    state = {"optimizer": first.optimizer.state_dict()} if legacy else first.checkpoint_state()
    folder = path.parent / f"resume-{legacy}"
    first.save_pretrained(folder)
    state = torch.load(_saved(state, folder), weights_only=False)
    resumed = make(folder, True)
    resumed.load_checkpoint_state(state)
    resumed.step(ragged_batch(1))
    expected = straight.state_dict()
    for name, w in resumed.state_dict().items():
        assert torch.equal(w, expected[name]), name


def _saved(state, folder):
    torch.save(state, folder / "trainer_state.pt")
    return folder / "trainer_state.pt"


def test_reference_model_is_loaded_and_run_only_when_its_logprobs_are_used(tiny_qwen3):
    path, _ = tiny_qwen3
    assert make(path, True, ref=path, ref_kl_every=0).ref_model is None  # kl_ref_coef = 0 and no logged k3
    every2 = make(path, True, ref=path, ref_kl_every=2)
    assert every2.ref_model is not None
    logged = [("kl_ref" in every2.step(ragged_batch(), iteration=it)) for it in range(4)]
    assert logged == [True, False, True, False]
    in_loss = make(path, True, ref=path, ref_kl_every=0, algo=AlgoConfig(kl_ref_coef=0.1))
    assert all("kl_ref" in in_loss.step(ragged_batch()) for _ in range(2))


def test_offload_needs_fsdp_and_cuda():
    with pytest.raises(ValueError, match="trainer.offload=true needs trainer.fsdp=true"):
        check_learner_options(torch.device("cuda"), fsdp=False, offload=True)
    with pytest.raises(ValueError, match="on device cpu they already are there"):
        check_learner_options(torch.device("cpu"), fsdp=True, offload=True)
