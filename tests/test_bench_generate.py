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
    # each KV4 row over the BF16-cache row of its batch, the question users ask first
    rows = {(x["kv_format"], x["batch_size"]): x for x in r["results"]}
    for batch in (2, 3):
        kv4, bf16 = rows["kv4", batch], rows["bf16", batch]
        assert bf16["speedup_vs_bf16_kv"] is None
        assert abs(kv4["speedup_vs_bf16_kv"] - kv4["engine_tokens_per_s"] / bf16["engine_tokens_per_s"]) < 1e-9
    assert "vs bf16 KV" in res.output


def test_bench_generate_without_transformers(tmp_path):
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "4", "--prompt-len", "3",
                              "--new-tokens", "5", "--no-hf", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (x,) = json.loads(out.read_text())["results"]
    assert x["engine_tokens"] == 20 and x["speedup"] is None and "hf_tokens" not in x


def test_bench_generate_times_async_scheduling_beside_sync_in_one_run(tmp_path):
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "3", "--prompt-len", "4",
                              "--new-tokens", "6", "--no-hf", "--scheduling", "sync,async", "--device", "cpu",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "async vs sync" in res.output and "bf16 async" in res.output
    r = json.loads(out.read_text())
    sync, ahead = r["results"]
    assert (sync["scheduling"], ahead["scheduling"]) == ("sync", "async")
    assert sync["engine_tokens"] == ahead["engine_tokens"] == 18 and ahead["engine_steps"] == sync["engine_steps"] == 6
    assert sync["speedup_vs_sync"] is None
    assert abs(ahead["speedup_vs_sync"] - ahead["engine_tokens_per_s"] / sync["engine_tokens_per_s"]) < 1e-9
    assert "async scheduling" in r["engine_summaries"]["bf16 async"]
    assert "async scheduling" not in r["engine_summaries"]["bf16 sync"]


def test_bench_generate_auto_scheduling_names_what_the_engine_chose(tmp_path):
    """The default, `auto`, is the engine's `engine.async_scheduling=auto`: synchronous on a CPU."""
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "2", "--prompt-len", "3",
                              "--new-tokens", "4", "--no-hf", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (x,) = json.loads(out.read_text())["results"]
    assert x["scheduling"] == "sync" and x["speedup_vs_sync"] is None


def test_bench_generate_refuses_async_scheduling_set_twice_and_unknown_schedulings():
    for extra in (["engine.async_scheduling=true"], ["--scheduling", "eager"], ["--scheduling", "auto,async"]):
        res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--no-hf", "--device", "cpu", *extra])
        assert res.exit_code == 2 and ("--scheduling" in res.output), res.output


def test_run_engine_warms_every_batch_size_before_timing_any():
    """Each batch's prompts run once (a few tokens) before the first timed batch, so no batch pays the
    one-time costs of its shapes inside its timing; the timed runs follow in the order given."""
    from types import SimpleNamespace

    import torch

    from kv4rl.bench.generate import WARMUP_TOKENS, run_engine

    calls = []

    class Recorder:
        device = torch.device("cpu")
        num_preemptions = 0
        last_step = {"new_tokens": 2, "batch_size": 2, "latency_s": 1e-3, "wait_s": 0.0, "prefill_tokens": 0}

        def generate(self, prompts, params, progress=None):
            calls.append((len(prompts), params.max_tokens))
            if progress:
                progress(0)
            return [SimpleNamespace(token_ids=[0] * params.max_tokens) for _ in prompts]

    prompts = {2: [[1, 2]] * 2, 5: [[1, 2]] * 5, 3: [[1, 2]] * 3}
    rows = run_engine(Recorder(), prompts, new_tokens=9, seed=0)
    assert calls == [(2, WARMUP_TOKENS), (5, WARMUP_TOKENS), (3, WARMUP_TOKENS), (2, 9), (5, 9), (3, 9)]
    assert [rows[b]["engine_tokens"] for b in (2, 5, 3)] == [18, 45, 27]


def test_bench_generate_times_fp8_weights_beside_the_models_own_in_one_run(tmp_path):
    """`--weight-format auto,fp8`: every engine row runs once per weight format on the same model and
    prompts; an fp8 row carries its ratio to the auto row of its KV format and batch."""
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "2,3", "--prompt-len", "4",
                              "--new-tokens", "5", "--no-hf", "--weight-format", "auto,fp8", "--device", "cpu",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "vs auto weights" in res.output
    r = json.loads(out.read_text())
    assert r["weight_formats"] == ["auto", "fp8"]
    rows = {(x["weight_format"], x["batch_size"]): x for x in r["results"]}
    assert list(rows) == [("auto", 2), ("auto", 3), ("fp8", 2), ("fp8", 3)]
    for batch in (2, 3):
        auto, fp8 = rows["auto", batch], rows["fp8", batch]
        assert auto["engine_tokens"] == fp8["engine_tokens"] == 5 * batch
        assert auto["speedup_vs_auto_weights"] is None
        assert abs(fp8["speedup_vs_auto_weights"] - fp8["engine_tokens_per_s"] / auto["engine_tokens_per_s"]) < 1e-9
    assert set(r["engine_summaries"]) == {"auto weights bf16", "fp8 weights bf16"}
    assert "fp8" in r["engine_summaries"]["fp8 weights bf16"] and "fp8" not in r["engine_summaries"]["auto weights bf16"]


def test_bench_generate_refuses_unknown_repeated_or_doubly_set_weight_formats():
    for extra, words in ((["--weight-format", "auto,int4"], "'int4'"), (["--weight-format", "fp8,fp8"], "given twice"),
                         (["--weight-format", "fp8", "engine.weight_format=fp8"], "engine.weight_format")):
        res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--no-hf", "--device", "cpu", *extra])
        assert res.exit_code == 2 and "--weight-format" in res.output or "engine.weight_format" in res.output, res.output
        assert words in res.output, res.output


def test_bench_generate_repeats_transformers_and_takes_the_median(tmp_path):
    """`--hf-repeats 3`: each batch's transformers run is timed three times; the row keeps the median run
    (its tokens/s between the slowest and the fastest) and the ratio is over it."""
    out = tmp_path / "gen.json"
    res = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--batch-sizes", "2", "--prompt-len", "3",
                              "--new-tokens", "4", "--hf-repeats", "3", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (x,) = json.loads(out.read_text())["results"]
    assert x["hf_repeats"] == 3 and x["hf_tokens"] == 8
    assert x["hf_tokens_per_s_min"] <= x["hf_tokens_per_s"] <= x["hf_tokens_per_s_max"]
    assert abs(x["hf_tokens_per_s"] - x["hf_tokens"] / x["hf_s"]) < 1e-6 * x["hf_tokens_per_s"]  # one real run
    assert abs(x["speedup"] - x["engine_tokens_per_s"] / x["hf_tokens_per_s"]) < 1e-9
    assert f"{x['hf_tokens_per_s_min']:,.0f}-{x['hf_tokens_per_s_max']:,.0f}]" in res.output.replace("\n", "")
    refused = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--hf-repeats", "0", "--device", "cpu"])
    assert refused.exit_code == 2 and "--hf-repeats must be >= 1" in refused.output, refused.output
    # two runs have no median run: the lower middle (the slower run) made the engine's ratio too high
    refused = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--hf-repeats", "2", "--device", "cpu"])
    assert refused.exit_code == 2 and "--hf-repeats 2: give an odd count" in refused.output, refused.output
    # with --no-hf nothing is timed three times: the option was accepted and applied to nothing
    refused = runner.invoke(app, ["bench", "generate", "--shape", "qwen3-tiny", "--hf-repeats", "3", "--no-hf",
                                  "--device", "cpu"])
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "--hf-repeats 3 times transformers' generate, which --no-hf leaves out" in text, text


def test_run_hf_times_every_batch_once_per_repeat_in_turn(monkeypatch):
    """Repeats alternate over the batches (all batches, then again), so a drift in the machine's speed
    reaches every batch alike; the median is the middle run by rate."""
    import torch

    import kv4rl.bench.generate as generate

    calls, seconds = [], iter([4.0, 1.0, 2.0, 1.0, 3.0, 1.0])  # batch 2 runs take 4, 2, 3 s; batch 5 runs 1 s each

    def fake_generate(model, prompts, new_tokens):
        calls.append((len(prompts), new_tokens))
        return torch.zeros(len(prompts), len(prompts[0]) + new_tokens)

    class FakeTimer:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.seconds, self.peak_gib = next(seconds), None

    monkeypatch.setattr(generate, "_hf_generate", fake_generate)
    monkeypatch.setattr(generate, "_Timer", FakeTimer)
    rows = generate.run_hf(None, {2: [[1]] * 2, 5: [[1]] * 5}, new_tokens=6, device=torch.device("cpu"), repeats=3)
    warm = generate.WARMUP_TOKENS
    assert calls == [(2, min(6, warm)), (5, min(6, warm))] + [(2, 6), (5, 6)] * 3
    assert rows[2]["hf_s"] == 3.0 and rows[2]["hf_tokens_per_s"] == 12 / 3.0  # the middle of 12/4, 12/3, 12/2
    assert (rows[2]["hf_tokens_per_s_min"], rows[2]["hf_tokens_per_s_max"]) == (3.0, 6.0)
    assert rows[5]["hf_tokens_per_s"] == 30.0 and rows[5]["hf_repeats"] == 3
