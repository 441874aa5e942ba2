"""`kv4rl bench generate` end to end on CPU with a tiny shape: both systems produce every token."""

import json

from typer.testing import CliRunner

from kv4rl.cli import app

runner = CliRunner()


def test_bench_generate_engine_and_transformers_generate_exact_token_counts(tmp_path):
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "2,3", "--prompt-len", "5",
                              "--new-tokens", "7", "--kv-format", "bf16,kv4", "--device", "cpu", "--json", str(out),
                              "engine.kv.group_size=32", "engine.kv.n_sink=2", "engine.kv.n_recent=4"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert [(x["kv_format"], x["batch_size"]) for x in r["results"]] == [("bf16", 2), ("bf16", 3), ("kv4", 2), ("kv4", 3)]
    for x in r["results"]:
        assert x["engine_tokens"] == x["hf_tokens"] == x["batch_size"] * 7
        # one prefill step, then one decode step per further token; no pool pressure
        assert x["engine_steps"] == 7 and x["decode_steps"] == 6 and x["preemptions"] == 0
        assert x["prefill_steps"] == 1 and x["prefill_tokens"] == x["batch_size"] * 5 and 0 < x["prefill_s"] < x["engine_s"]
        assert x["engine_tokens_per_s"] > 0 and x["hf_tokens_per_s"] > 0
        assert 0 < x["decode_host_ms"] <= x["decode_step_ms"]  # the step less its wait for the device
        assert abs(x["speedup"] - x["engine_tokens_per_s"] / x["hf_tokens_per_s"]) < 1e-9
    assert set(r["engine_summaries"]) == {"bf16", "kv4"}
    assert "max_num_seqs x max_model_len" in r["engine_summaries"]["kv4"]


def test_bench_generate_without_transformers(tmp_path):
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "4", "--prompt-len", "3",
                              "--new-tokens", "5", "--no-hf", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (x,) = json.loads(out.read_text())["results"]
    assert x["engine_tokens"] == 20 and x["speedup"] is None and "hf_tokens" not in x
