"""`kv4rl bench pool`: tokens per format in a budget, against byte counts worked out by hand."""

import json

from typer.testing import CliRunner

from kv4rl.cli import app

runner = CliRunner()

LAYERS, KV_HEADS = 36, 8  # qwen3-8b, head_dim 128
# bytes per token per layer per KV head for K and V together, from the formats' layouts
PAGE = {
    "bf16": 2 * 128 * 2,
    "fp8": (128 + 4) * 2,  # e4m3 codes + fp32 scale per token and head
    "int4": (64 + 2 + 2) * 2,  # packed codes + fp16 scale + fp16 zero per group of 128
    "kv4": (64 + 2 + 2) * 2,
    "nvfp4": (64 + 8) * 2,  # packed codes + one e4m3 scale per 16 values
    "mxfp4": (64 + 4) * 2,  # packed codes + one e8m0 exponent per 32 values
}
KV4_ROWS_PER_SEQ = (128 + 4) * 2 * KV_HEADS * 144 * LAYERS  # INT8 codes + fp32 scale, 16 sink + 128 recent
NVFP4_TENSOR_SCALES = 4 * 2 * LAYERS  # one fp32 per-tensor scale for K and one for V in every layer


def expected_tokens(fmt, budget, seqs, block=16):
    block_bytes = PAGE[fmt] * KV_HEADS * LAYERS * block
    fixed = KV4_ROWS_PER_SEQ * seqs if fmt == "kv4" else NVFP4_TENSOR_SCALES if fmt == "nvfp4" else 0
    return (budget - fixed) // block_bytes * block


def test_bench_pool_counts_each_formats_bytes(tmp_path):
    out = tmp_path / "pool.json"
    res = runner.invoke(app, ["bench", "pool", "--shape", "qwen3-8b", "--memory-gib", "40", "--max-num-seqs", "256",
                              "--context", "8192", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    budget = 40 * 2**30
    rows = {x["format"]: x for x in r["results"]}
    assert list(rows) == ["bf16", "fp8", "int4", "kv4", "nvfp4", "mxfp4"]
    bf16 = expected_tokens("bf16", budget, 256)
    for fmt, row in rows.items():
        assert row["tokens"] == expected_tokens(fmt, budget, 256), fmt
        assert row["bytes_per_token"] == PAGE[fmt] * KV_HEADS * LAYERS
        assert abs(row["tokens_vs_bf16"] - expected_tokens(fmt, budget, 256) / bf16) < 1e-12
    assert rows["kv4"]["reserve_bytes"] == 256 * KV4_ROWS_PER_SEQ
    assert abs(rows["kv4"]["bytes_per_token_at_context"] - (PAGE["kv4"] * KV_HEADS * LAYERS + KV4_ROWS_PER_SEQ / 8192)) < 1e-6
    assert rows["int4"]["sequences_at_context"] == min(256, expected_tokens("int4", budget, 256) // 8192)
    assert "kv4" in res.output and "1.00x" in res.output


def test_bench_pool_takes_engine_kv_settings_and_refuses_a_budget_below_the_reserve(tmp_path):
    out = tmp_path / "pool.json"
    res = runner.invoke(app, ["bench", "pool", "--formats", "kv4", "--memory-gib", "8", "--json", str(out),
                              "engine.kv.group_size=64", "engine.kv.n_recent=48"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["results"]
    page = (64 + 2 * 2 * 2) * 2  # two groups of 64: two fp16 scales and two fp16 zeros
    reserve = (128 + 4) * 2 * KV_HEADS * (16 + 48) * LAYERS * 256
    assert row["tokens"] == (8 * 2**30 - reserve) // (page * KV_HEADS * LAYERS * 16) * 16
    res = runner.invoke(app, ["bench", "pool", "--formats", "kv4", "--memory-gib", "1"])
    assert res.exit_code == 2 and "reserved" in res.output


def test_a_budget_without_one_bf16_block_still_measures_the_formats_asked_for(tmp_path):
    """`--formats int4` in 0.001 GiB failed with "bf16: ... does not hold the rows reserved for 1 sequences":
    bf16 was not asked for, reserves no rows, and int4's 612 KiB block fits."""
    out = tmp_path / "pool.json"
    res = runner.invoke(app, ["bench", "pool", "--shape", "qwen3-8b", "--memory-gib", "0.001", "--formats", "int4",
                              "--max-num-seqs", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["results"]
    assert row["tokens"] == expected_tokens("int4", int(0.001 * 2**30), 1) == 16
    assert row["tokens_vs_bf16"] is None and row["sequences_at_context"] == 0
    res = runner.invoke(app, ["bench", "pool", "--shape", "qwen3-8b", "--memory-gib", "0.001", "--formats", "bf16",
                              "--max-num-seqs", "1"])
    assert res.exit_code == 2 and "bf16: 0.001 GiB holds no block (2.25 MiB)" in res.output
    assert "reserved" not in res.output
