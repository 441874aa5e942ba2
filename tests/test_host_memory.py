"""The offloaded learner's host memory is checked before any model is loaded: an 8B learner under
`trainer.offload` (16 bytes per parameter on the host) was OOM-killed on a 125 GiB host with no error
of its own. Hand-worked byte counts, the parameter count against a loaded model, and the refusal as
`kv4rl train` shows it."""

import pytest

from kv4rl.trainer import host_memory
from kv4rl.trainer.host_memory import check_host_memory, count_parameters

GB = 10**9
QWEN3_8B = 8_190_735_360  # parameters of the Qwen3-8B shape (36 layers, hidden 4096, vocab 151,936)


def test_the_8b_learner_under_offload_is_refused_on_a_125_gib_host_and_fits_with_offload_optimizer():
    host = 125 * 2**30  # 134.2 GB; 90% of it is 120.8 GB
    with pytest.raises(ValueError, match=r"trainer.offload=true keeps 16 bytes .* 131\.1 GB .* 8\.19B .* "
                                         r"134\.2 GB available.*trainer.offload_optimizer=true .* 65\.5 GB"):
        check_host_memory(QWEN3_8B, offload=True, offload_optimizer=False, available=host)
    check_host_memory(QWEN3_8B, offload=False, offload_optimizer=True, available=host)  # 65.5 GB fits
    with pytest.raises(ValueError, match=r"trainer.offload_optimizer=true keeps 8 bytes .* 65\.5 GB"):
        check_host_memory(QWEN3_8B, offload=False, offload_optimizer=True, available=70 * GB)


def test_the_limit_is_the_headroom_share_and_ranks_on_other_hosts_take_their_share_away():
    n = 10**9  # 16 GB under offload
    check_host_memory(n, offload=True, offload_optimizer=False, available=int(16 * GB / 0.9) + 1)
    with pytest.raises(ValueError):
        check_host_memory(n, offload=True, offload_optimizer=False, available=int(16 * GB / 0.9) - 10**6)
    # 4 ranks: all on this host need the whole 16 GB here; 1 rank per host needs a quarter of it
    with pytest.raises(ValueError, match="16.0 GB"):
        check_host_memory(n, offload=True, offload_optimizer=False, world_size=4, local_world_size=4,
                          available=10 * GB)
    check_host_memory(n, offload=True, offload_optimizer=False, world_size=4, local_world_size=1, available=10 * GB)


def test_nothing_is_checked_without_offload_or_where_the_memory_is_unknown(monkeypatch):
    check_host_memory(QWEN3_8B, offload=False, offload_optimizer=False, available=1)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: None)
    check_host_memory(QWEN3_8B, offload=True, offload_optimizer=False)
    monkeypatch.undo()
    assert host_memory.available_host_bytes() is None or host_memory.available_host_bytes() > 0


def test_the_parameter_count_comes_from_the_config_alone(tiny_qwen3):
    path, model = tiny_qwen3
    assert count_parameters(path) == sum(p.numel() for p in model.parameters())


def test_qwen3_8b_shape_count():
    """The byte counts above use the Qwen3-8B shape's parameter count, as the config gives it."""
    from kv4rl.bench.random_model import qwen3_args

    a = qwen3_args("qwen3-8b")
    h, i, hd = a.hidden_size, a.intermediate_size, a.head_dim
    attention = h * a.num_heads * hd + 2 * h * a.num_kv_heads * hd + a.num_heads * hd * h
    per_layer = attention + 3 * h * i + 2 * h + 2 * hd  # q|k|v|o, gate|up|down, two norms, q/k norms
    assert not a.tie_word_embeddings and a.num_layers == 36 and h == 4096 and a.vocab_size == 151_936
    assert a.num_layers * per_layer + 2 * a.vocab_size * h + h == QWEN3_8B  # embeddings, LM head, final norm
