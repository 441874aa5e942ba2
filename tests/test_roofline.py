"""The decode step's byte roofline: the weight bytes counted against the shapes by hand, and `bench
generate` / `bench decode-forward` reporting the fraction of it a step reaches."""

import dataclasses

import pytest
import torch

from kv4rl.bench.generate import bench_generate
from kv4rl.bench.random_model import qwen3_args, random_decoder
from kv4rl.bench.roofline import copy_bandwidth, roofline_ms, weight_bytes_per_step
from kv4rl.bench.tables import decode_forward_table, generate_table
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.fp8_weights import apply_fp8_weights
from kv4rl.models.decoder import Decoder


def layer_matrices(a) -> list[tuple[int, int]]:
    """(out, in) of one layer's seven projections."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return [(q, a.hidden_size), (kv, a.hidden_size), (kv, a.hidden_size), (a.hidden_size, q),
            (a.intermediate_size, a.hidden_size), (a.intermediate_size, a.hidden_size),
            (a.hidden_size, a.intermediate_size)]


def norm_elements(a) -> int:
    """Per layer: input and post-attention norms (hidden), q and k norms (head_dim)."""
    return 2 * a.hidden_size + 2 * a.head_dim


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_are_the_layers_and_the_head_once_without_the_row_tables(tied):
    a = dataclasses.replace(qwen3_args("qwen3-tiny"), tie_word_embeddings=tied)
    model = Decoder(a, dtype=torch.bfloat16)
    model.tie_weights()
    model.rotary.build_cache(torch.device("cpu"))  # 2 x 512 x 16 float32 rows: left out
    per_layer = sum(o * i for o, i in layer_matrices(a)) + norm_elements(a)
    # the head (vocab x hidden) once whether tied or not; the untied embedding table is left out
    elements = a.num_layers * per_layer + a.hidden_size + a.vocab_size * a.hidden_size
    assert weight_bytes_per_step(model) == 2 * elements


def test_fp8_weights_count_one_byte_per_element_and_a_float32_scale_per_row():
    model = random_decoder("qwen3-tiny", "cpu", dtype=torch.bfloat16)  # tied embeddings, as Qwen3-1.7B
    a = model.args
    apply_fp8_weights(model)
    linears = sum(o * i + 4 * o for o, i in layer_matrices(a))  # e4m3 codes + one fp32 scale per row
    expected = a.num_layers * (linears + 2 * norm_elements(a)) + 2 * (a.hidden_size + a.vocab_size * a.hidden_size)
    assert weight_bytes_per_step(model) == expected


def test_roofline_is_bytes_over_bandwidth_and_cpu_has_none():
    assert roofline_ms(3.0e9, 1.2e9, 4.2e12) == pytest.approx(1.0)
    assert copy_bandwidth(torch.device("cpu")) is None


def test_bench_generate_reports_each_decode_steps_roofline_against_a_hand_count():
    """Prompt 5, 4 new tokens, batch 2, lockstep: decode steps 1-3 attend to 6, 7, 8 positions per
    sequence (the step record's context also counts the token each step sampled, which no attention read)."""
    res = bench_generate("qwen3-tiny", batch_sizes=[2], prompt_len=5, new_tokens=4, hf=False, device="cpu",
                         bandwidth=1e9)
    (row,) = res["results"]
    a = qwen3_args("qwen3-tiny")
    bytes_per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2  # bf16 K and V
    weights = 4 * (a.num_layers * (sum(o * i for o, i in layer_matrices(a)) + norm_elements(a))
                   + a.hidden_size + a.vocab_size * a.hidden_size)  # float32 on CPU
    expected = sum(1e3 * (weights + 2 * ctx * bytes_per_token) / 1e9 for ctx in (6, 7, 8)) / 3
    assert row["decode_steps"] == 3 and row["decode_roofline_ms"] == pytest.approx(expected, rel=1e-12)
    assert row["decode_of_roofline"] == pytest.approx(expected / row["decode_step_ms"])
    assert res["roofline_bandwidth_bytes_per_s"] == 1e9
    table = generate_table(res)
    assert table.rows[0][table.headers.index("of byte roofline")].endswith(f"of {expected:.2f} ms")
    bare = bench_generate("qwen3-tiny", batch_sizes=[2], prompt_len=3, new_tokens=2, hf=False, device="cpu")
    assert bare["results"][0]["decode_of_roofline"] is None  # no measured bandwidth on a CPU


def test_bench_generate_counts_kv4_rows_as_its_decode_kernels_read_them():
    """KV4 with 2 sink and 3 recent rows: a step attending to 6, 7, 8 positions reads 5 of them as INT8 rows
    (a code per channel and a float32 scale) and the other 1, 2, 3 as INT4 rows (two codes a byte, an fp16
    scale and an fp16 zero per 32-channel group). It spread the INT8 rows over max_model_len before."""
    res = bench_generate("qwen3-tiny", batch_sizes=[2], prompt_len=5, new_tokens=4, hf=False, device="cpu",
                         bandwidth=1e9, kv_formats=["kv4"],
                         engine_config=EngineConfig(kv=KVConfig(format="kv4", n_sink=2, n_recent=3, group_size=32)))
    (row,) = res["results"]
    a = qwen3_args("qwen3-tiny")
    d = a.head_dim
    int8_row, int4_row = d + 4, d // 2 + 4 * (d // 32)
    weights = 4 * (a.num_layers * (sum(o * i for o, i in layer_matrices(a)) + norm_elements(a))
                   + a.hidden_size + a.vocab_size * a.hidden_size)
    kv = [a.num_layers * 2 * a.num_kv_heads * (5 * int8_row + (ctx - 5) * int4_row) for ctx in (6, 7, 8)]
    expected = sum(1e3 * (weights + 2 * b) / 1e9 for b in kv) / 3
    assert row["decode_steps"] == 3 and row["decode_roofline_ms"] == pytest.approx(expected, rel=1e-12)


def test_decode_forward_table_shows_the_fraction_of_the_roofline():
    row = {"shape": "qwen3-8b", "workload": "late", "weights": "bf16", "kv": "kv4", "batch": 64, "context": 8192,
           "ms": 8.0, "tokens_per_s": 8000.0, "speedup_vs_bf16": 2.0, "roofline_ms": 6.0, "of_roofline": 0.75}
    table = decode_forward_table({"device": "H200", "results": [row, dict(row, roofline_ms=None, of_roofline=None)]},
                                 fused_ops=True)
    column = table.headers.index("of byte roofline")
    assert [r[column] for r in table.rows] == ["75% of 6.00 ms", "-"]


def test_decode_forward_roofline_reads_the_weights_and_every_layers_kv_once():
    from kv4rl.bench.decode_forward import step_roofline

    model = random_decoder("qwen3-tiny", "cpu", dtype=torch.bfloat16)
    a = model.args
    kv = a.num_layers * 2 * 3 * 40 * a.num_kv_heads * a.head_dim * 2  # K and V, batch 3 x 40 tokens, bf16
    got = step_roofline(model, "bf16", 3, 40, ms=2.0, bandwidth=1e9)
    assert got["roofline_ms"] == pytest.approx(1e3 * (weight_bytes_per_step(model) + kv) / 1e9)
    assert got["of_roofline"] == pytest.approx(got["roofline_ms"] / 2.0)
    assert step_roofline(model, "bf16", 3, 40, ms=2.0, bandwidth=None) == {"roofline_ms": None, "of_roofline": None}


def test_step_layout_gives_each_sequence_its_own_blocks_for_its_context():
    """`bench decode-forward`'s (and `bench rollout`'s pure step's) host inputs, worked by hand for
    contexts 5, 16, 1 at block size 8: 1, 3 and 1 blocks (room for the next token), 5 blocks in all,
    each used once; the last token of each sequence sits at its context - 1 in its own blocks."""
    from kv4rl.bench.decode_forward import step_layout

    lay = step_layout(3, [5, 16, 1], block_size=8, vocab_size=50, seed=1)
    assert lay["num_blocks"] == 5
    tables = lay["block_tables"]
    assert tables.shape == (3, 3)
    used = [tables[0, :1], tables[1, :3], tables[2, :1]]
    assert sorted(int(b) for row in used for b in row) == [0, 1, 2, 3, 4]
    assert lay["positions"].tolist() == [4, 15, 0]
    assert lay["context_lens"].tolist() == [5, 16, 1]
    expected = [tables[0, 0] * 8 + 4, tables[1, 1] * 8 + 7, tables[2, 0] * 8 + 0]
    assert lay["slots"].tolist() == [int(x) for x in expected]
    # equal contexts: the permutation laid out row by row, as the bench had it before per-row contexts
    import numpy as np

    uniform = step_layout(4, 20, block_size=8, vocab_size=50, seed=3)
    perm = np.random.default_rng(3).permutation(4 * 3).astype(np.int32).reshape(4, 3)
    assert (uniform["block_tables"] == perm).all() and uniform["num_blocks"] == 12
    with pytest.raises(ValueError, match="contexts"):
        step_layout(2, [3], block_size=8, vocab_size=50)


def test_decode_forward_under_tensor_parallel_times_both_steps_with_the_same_fp8_settings(monkeypatch):
    """The sharded step and rank 0's one-GPU step of the ratio run with the caller's FP8 product and
    FP8-input settings (the TP path once dropped `--no-fp8-inputs`)."""
    from types import SimpleNamespace

    import kv4rl.bench.decode_forward as df
    import kv4rl.distributed as distributed
    import kv4rl.models.tensor_parallel as tensor_parallel

    calls = []
    monkeypatch.setattr(distributed, "init_from_torchrun", lambda device: None)
    monkeypatch.setattr(distributed, "barrier", lambda group=None: None)
    monkeypatch.setattr(tensor_parallel, "tensor_parallel_group", lambda size: SimpleNamespace(rank=0, size=size))
    monkeypatch.setattr(df, "run_decode_forward", lambda *a, **kw: calls.append(kw) or {"results": []})
    monkeypatch.setattr(df, "add_tp1_ratio", lambda res, one: None)
    df.run_decode_forward_tp(["qwen3-8b"], ["late"], 2, True, fp8_gemm="scaled_mm", fp8_inputs=False)
    assert [(kw["fp8_gemm"], kw["fp8_inputs"], "tp" in kw) for kw in calls] == [("scaled_mm", False, True),
                                                                                ("scaled_mm", False, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_copy_bandwidth_matches_a_copy_timed_apart():
    """The probe's rate against eight 256 MiB copies timed here first, with their own events (read + write
    bytes), and the table's H200 rate where the device is one: within 15% (both are this card's copy rate).
    The reference is timed before the probe: right after it, in buffers allocated after its `empty_cache`,
    the same copies read 2.55 TB/s on an H100 whose copies run at 3.0 (the probe's 3.01; the gap was not
    examined further)."""
    from kv4rl.bench.roofline import COPY_BYTES_PER_S, measure_copy_bandwidth

    src = torch.ones(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    for _ in range(2):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(8):
        dst.copy_(src)
    end.record()
    end.synchronize()
    assert bool((dst == 1).all())
    apart = 8 * 2 * src.numel() / (start.elapsed_time(end) / 1e3)
    del src, dst
    measured = measure_copy_bandwidth(torch.cuda.current_device())
    assert 0.85 < measured / apart < 1.15, (measured, apart)
    name = torch.cuda.get_device_name()
    if "H200" in name:
        assert 0.85 < measured / COPY_BYTES_PER_S["H200"] < 1.15, measured
    assert copy_bandwidth(torch.device("cuda")) == (COPY_BYTES_PER_S["H200"] if "H200" in name else measured)
