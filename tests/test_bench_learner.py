"""`kv4rl bench learner` on CPU with the test shape: token counts, padding and FLOPs against a hand count."""

import json

from typer.testing import CliRunner

from kv4rl.cli import app

# qwen3-tiny: hidden 64, 4 query heads and 2 KV heads of 32, MLP 128, 2 layers, vocabulary 1024 (tied head)
LINEAR_PARAMS = 2 * (64 * 128 + 64 * 64 + 64 * 64 + 128 * 64 + 3 * 64 * 128) + 1024 * 64


def run(tmp_path, *args):
    out = tmp_path / "learner.json"
    res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--steps", "1",
                                   "--json", str(out), *args])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_uniform_workload_counts_and_flops(tmp_path):
    res = run(tmp_path, "--num-seqs", "3", "--prompt-len", "4", "--seq-len", "12", "--micro-batch-size", "2",
              "--max-tokens", "24", "--checkpointing", "off,on", "--reference", "on")
    assert res["matmul_params"] == LINEAR_PARAMS == 163_840
    assert (res["tokens"], res["response_tokens"], res["padded_width"]) == (36, 24, 12)
    assert [(r["layout"], r["attention"], r["checkpointing"], r["reference"]) for r in res["results"]] == [
        ("padded", "sdpa", False, True), ("packed", "sdpa", False, True),
        ("padded", "sdpa", True, True), ("packed", "sdpa", True, True)]
    # update 6·N·36 + ref forward 2·N·36; causal attention per layer and row 2·12²·4·32, 3 passes + 1
    flops = 8 * LINEAR_PARAMS * 36 + 4 * 2 * 3 * (2 * 12**2 * 4 * 32)
    for r in res["results"]:
        assert r["computed_tokens"] == 36 and r["padding_fraction"] == 0.0
        assert r["micro_batches"] == 2  # rows {0, 1}, {2}: 2 rows of 12, or 24 tokens
        assert r["flops_per_step"] == flops
        assert r["tokens_per_s"] == 36 / r["step_s"] and r["peak_gib"] is None
        assert r["mfu"] is None and r["mfu_780"] is None  # a GPU's peak means nothing on the CPU (a helper's find)


def test_mfu_is_the_steps_flops_over_the_gpus_peak_and_none_off_cuda():
    import torch

    from kv4rl.bench.learner import model_flops_utilization

    got = model_flops_utilization(2.0e15, 4.0, torch.device("cuda", 0))
    assert got == {"mfu": 2.0e15 / 4.0 / 989e12, "mfu_780": 2.0e15 / 4.0 / 780e12}
    assert model_flops_utilization(2.0e15, 4.0, torch.device("cpu")) == {"mfu": None, "mfu_780": None}


def test_an_option_of_the_other_workload_is_refused_before_any_work(tmp_path):
    """`--sigma 2` under the uniform workload (or `--seq-len` under lognormal), and a micro-batch size of a layout
    not timed, used to be ignored without a word."""
    out = tmp_path / "learner.json"
    for args, named in ((["--sigma", "2"], "--sigma"), (["--median-len", "5", "--max-len", "9"], "--median-len, --max-len"),
                        (["--workload", "lognormal", "--seq-len", "12"], "--seq-len")):
        res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu",
                                       "--json", str(out), *args])
        assert res.exit_code != 0 and named in res.output and "only" in res.output, res.output
        assert not out.exists()
    for args, named in ((["--layouts", "padded", "--max-tokens", "1000"], "--max-tokens 1000 sizes packed"),
                        (["--layouts", "packed", "--micro-batch-size", "2"], "--micro-batch-size 2 sizes padded")):
        res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--seq-len", "12",
                                       "--prompt-len", "4", *args])
        assert res.exit_code != 0 and named in res.output, res.output
    # the other workload's options at their defaults, as a script may pass them, are fine
    run(tmp_path, "--seq-len", "12", "--prompt-len", "4", "--sigma", "1.0", "--max-len", "8192",
        "--checkpointing", "off", "--reference", "off", "--layouts", "packed")


def test_lognormal_workload_padding(tmp_path):
    res = run(tmp_path, "--workload", "lognormal", "--num-seqs", "5", "--prompt-len", "3", "--median-len", "6",
              "--max-len", "40", "--max-tokens", "64", "--checkpointing", "off", "--reference", "off")
    assert [r["fuse_elementwise"] for r in res["results"]] == [False, False]  # off unless asked
    lengths = res["sequence_lengths"]
    assert len(lengths) == 5 and all(4 <= n <= 43 for n in lengths) and len(set(lengths)) > 1
    assert res["tokens"] == sum(lengths) and res["response_tokens"] == sum(lengths) - 5 * 3
    assert res["padded_width"] == max(lengths)
    padded, packed = res["results"]
    assert padded["computed_tokens"] == 5 * max(lengths) and packed["computed_tokens"] == sum(lengths)
    assert padded["padding_fraction"] == 1 - sum(lengths) / (5 * max(lengths)) > 0 == packed["padding_fraction"]


def test_flex_attention_is_refused_on_the_cpu_before_any_work(tmp_path):
    out = tmp_path / "learner.json"
    res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--attention",
                                   "sdpa,flex", "--seq-len", "12", "--prompt-len", "4", "--json", str(out)])
    assert res.exit_code != 0 and "--attention flex needs a CUDA device" in res.output
    assert not out.exists()
    res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--attention",
                                   "flash", "--seq-len", "12", "--prompt-len", "4"])
    assert res.exit_code != 0 and "--attention" in res.output and "flash" in res.output


def test_each_variant_is_handed_over_as_soon_as_it_is_timed():
    """A bench stopped by a time limit keeps what it measured: `on_result` gets the variants timed so far."""
    import torch

    from kv4rl.bench.learner import LearnerWorkload, bench_learner

    seen = []
    work = LearnerWorkload(num_seqs=2, prompt_len=4, seq_len=10)
    res = bench_learner("qwen3-tiny", work, device=torch.device("cpu"), steps=1, micro_batch_size=1, max_tokens=20,
                        checkpointing=(False, True), reference=(False,),
                        on_result=lambda partial: seen.append((partial["complete"], list(partial["results"]))))
    assert [len(rows) for _, rows in seen] == [1, 2, 3, 4] and not any(done for done, _ in seen)
    assert res["complete"] and seen[-1][1] == res["results"]
    for (_, earlier), (_, later) in zip(seen, seen[1:]):
        assert later[:len(earlier)] == earlier  # rows are only ever added


def test_fused_elementwise_variants_are_timed_beside_the_eager_ones(tmp_path):
    res = run(tmp_path, "--num-seqs", "2", "--prompt-len", "4", "--seq-len", "12", "--layouts", "packed",
              "--checkpointing", "off", "--reference", "off", "--fuse-elementwise", "off,on")
    assert [(r["layout"], r["fuse_elementwise"], r["compile_layers"]) for r in res["results"]] == [
        ("packed", False, False), ("packed", True, False)]  # --compile-layers: off by default
    assert all(r["step_s"] > 0 for r in res["results"])


def test_compile_layers_settings_are_checked_before_any_work(tmp_path):
    """`--compile-layers off,on` times each variant (the compiled learner: tests/test_compiled_layers.py;
    a run here would cost CI half a minute of compilation); a setting other than off/on is refused."""
    bad = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--seq-len", "12",
                                   "--prompt-len", "4", "--compile-layers", "yes"])
    assert bad.exit_code != 0 and "--compile-layers" in bad.output and "yes" in bad.output


def test_fused_logprobs_is_refused_before_any_work_where_its_kernels_cannot_run(tmp_path, monkeypatch):
    """`--fused-logprobs on` needs the Triton kernels (CUDA; the learner test runs them in the interpreter:
    tests/test_learner_fused_logprobs.py); elsewhere it is refused by name and nothing is written."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "learner.json"
    bad = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--seq-len", "12",
                                   "--prompt-len", "4", "--fused-logprobs", "off,on", "--json", str(out)])
    text = " ".join(bad.output.split())  # the option given, not a config key the user never set
    assert bad.exit_code != 0 and "--fused-logprobs on runs Triton kernels" in text and "use --fused-logprobs off" in text
    assert not out.exists()


def test_the_table_says_when_a_row_is_longer_than_the_packing_limit_and_shows_mfu_only_on_a_gpu(tmp_path):
    """--max-tokens 8 with rows of 12 tokens: each row is a micro-batch of its own, which the title said was
    "<= 8 tokens"; MFU against an H200's peak meant nothing on the CPU."""
    out = tmp_path / "learner.json"
    res = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--steps", "1",
                                   "--num-seqs", "2", "--prompt-len", "4", "--seq-len", "12", "--max-tokens", "8",
                                   "--checkpointing", "off", "--reference", "off", "--json", str(out)], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "<= 8 tokens (packed, a longer row (up to 12) alone)" in text and "MFU only on a GPU" in text
    assert "%" in text  # the padding column
    assert json.loads(out.read_text())["results"][1]["micro_batches"] == 2


def test_the_entropy_objectives_are_timed_and_recorded(tmp_path):
    """`--entropy-coeff` / `--top-entropy-quantile` run every variant under them (the entropy's gradient, the
    quantile); a share outside [0, 1] is refused before any work."""
    res = run(tmp_path, "--num-seqs", "2", "--prompt-len", "4", "--seq-len", "12", "--layouts", "padded",
              "--checkpointing", "off", "--reference", "off", "--entropy-coeff", "0.01", "--top-entropy-quantile", "0.5")
    assert res["algo"] == {"entropy_coeff": 0.01, "top_entropy_quantile": 0.5}
    assert len(res["results"]) == 1 and res["results"][0]["step_s"] > 0
    bad = CliRunner().invoke(app, ["bench", "learner", "--shape", "qwen3-tiny", "--device", "cpu", "--seq-len", "12",
                                   "--prompt-len", "4", "--top-entropy-quantile", "1.5", "--json",
                                   str(tmp_path / "bad.json")])
    assert bad.exit_code != 0 and "algo.top_entropy_quantile must be in [0, 1]" in bad.output
    assert not (tmp_path / "bad.json").exists()
