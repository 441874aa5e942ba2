"""`kv4rl bench rollout` and `kv4rl plot rollout-trace` on CPU."""

import json

from typer.testing import CliRunner

from kv4rl.cli import app
from kv4rl.config import load_config
from kv4rl.loop import train

runner = CliRunner()


def test_bench_rollout_sync_vs_partial(tiny_qwen3, tmp_path):
    path, _ = tiny_qwen3
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", "rollout", "--model", str(path), "--device", "cpu", "--quota-groups", "4",
                              "--group-size", "2", "--max-slots", "8", "--batches", "2", "--prompt-len", "4",
                              "--median-len", "4", "--max-len", "30", "--sigma", "1.2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    modes = {x["mode"]: x for x in r["results"]}
    assert set(modes) == {"sync", "partial"}
    for x in modes.values():
        assert x["rollout_s"] > 0 and 0 < x["slot_util"] <= 1 and x["tokens_per_s"] > 0
    # the same long-tailed lengths: partial keeps its slots fuller and needs fewer engine steps per batch
    assert modes["partial"]["slot_util"] > modes["sync"]["slot_util"]
    assert modes["partial"]["steps_per_batch"] < modes["sync"]["steps_per_batch"]
    assert abs(r["speedup"] - modes["sync"]["rollout_s"] / modes["partial"]["rollout_s"]) < 1e-9


def test_plot_rollout_trace_side_by_side(tmp_path):
    runs = []
    for mode in ("sync", "partial"):
        cfg = load_config(overrides=[f"name={mode}", f"out_dir={tmp_path}", "device=cpu", "trainer.iterations=2",
                                     f"rollout.mode={mode}", "rollout.quota_groups=4", "rollout.max_slots=16"])
        train(cfg, show_progress=False)
        trace = [json.loads(line) for line in (cfg.run_dir / "rollout_trace.jsonl").read_text().splitlines()]
        assert {t["iteration"] for t in trace} == {0, 1}
        assert all(t["batch_size"] <= 16 and t["latency_s"] > 0 and t["kv_bytes"] > 0 for t in trace)
        runs.append(str(cfg.run_dir))
    png = tmp_path / "trace.png"
    res = runner.invoke(app, ["plot", "rollout-trace", *runs, "--out", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
