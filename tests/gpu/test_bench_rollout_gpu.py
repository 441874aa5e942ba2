"""`kv4rl bench rollout` on CUDA: every corner is set against a pure decode step (a CUDA-graph replay of
its mean batch at its mean context, built with the engine's own KV format)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kv4rl.cli import app

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_each_corner_has_its_pure_decode_step(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, [
        "bench", "rollout", "--shape", "qwen3-tiny", "--device", "cuda", "--formats", "bf16,fp8,kv4",
        "--modes", "sync,partial", "--quota-groups", "4", "--group-size", "4", "--max-slots", "16",
        "--prompt-len", "32", "--median-len", "64", "--max-len", "256", "--repeats", "1",
        "--kv-budget-gib", "0.05", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["format"], r["mode"]) for r in rows] == [(f, m) for f in ("bf16", "fp8", "kv4")
                                                        for m in ("sync", "partial")]
    for r in rows:
        assert (r["pure_step_batch"], r["pure_step_context"]) == (round(r["mean_active"]), round(r["context_mean"]))
        assert r["pure_step_ms"] > 0
        assert r["step_vs_pure"] == pytest.approx(r["step_ms"] / r["pure_step_ms"])
        # and against the rows and contexts the engine ran at a few of its steps
        assert r["row_context_snapshots"] and r["pure_rows_ms"] > 0
        assert r["step_vs_pure_rows"] == pytest.approx(r["step_ms"] / r["pure_rows_ms"])
    assert "step / pure" in res.output


def test_partial_rollout_admissions_replay_prefill_graphs(tmp_path):
    """With `engine.prefill_graph_tokens`, the prompts admitted in partial rollout (32 tokens, one row a
    group) replay a prefill graph: as many a batch as the groups whose prompt is computed in it."""
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, [
        "bench", "rollout", "--shape", "qwen3-tiny", "--device", "cuda", "--formats", "kv4", "--modes", "partial",
        "--quota-groups", "4", "--group-size", "4", "--max-slots", "8", "--prompt-len", "32", "--median-len", "64",
        "--max-len", "256", "--repeats", "1", "--kv-budget-gib", "0.05", "engine.prefill_graph_tokens=256",
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["results"]
    assert row["graph_prefills_per_batch"] > 0
    assert row["graph_prefills_per_batch"] <= row["mixed_steps_per_batch"]
