"""`kv4rl sim` commands through typer's runner: the files they write hold the right numbers."""

import json

import pytest
from typer.testing import CliRunner

from kv4rl.cli_sim import sim_app

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ppo_coefficient(rho, eps, adv):
    """d/dlogπ of min(ρA, clip(ρ)A), worked by hand: ρA while the unclipped branch is active, else 0."""
    clipped = (adv > 0 and rho > 1 + eps) or (adv < 0 and rho < 1 - eps)
    return 0.0 if clipped else rho * adv


def exact_moments(values):
    """Mean, variance and 4th central moment of equally likely outcomes."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    m4 = sum((v - mean) ** 4 for v in values) / len(values)
    return mean, var, m4


def assert_within_mc_error(result, branch, rho, eps, sigma, n):
    outcomes = [ppo_coefficient(rho, eps, a) if branch == "clip" else rho * a for a in (sigma, -sigma)]
    mean, var, m4 = exact_moments(outcomes)
    mean_tol = 5 * (var / n) ** 0.5
    # the sample variance: 5 se of the mean square, plus the (mean error)^2 term at 5 se
    var_tol = 5 * (max(m4 - var**2, 0.0) / n) ** 0.5 + 25 * var / n
    got = result[branch]
    assert abs(got["mean"] - mean) <= mean_tol + 1e-12, (branch, rho, got, mean)
    assert abs(got["var"] - var) <= var_tol + 1e-12, (branch, rho, got, var)


def test_clip_bias_matches_closed_form_and_plots(tmp_path):
    out, png, n = tmp_path / "cb.json", tmp_path / "cb.png", 20_000
    result = runner.invoke(sim_app, ["clip-bias", "--rho", "1.5", "--eps", "0.2", "--sigma", "1.0",
                                     "--samples", str(n), "--seed", "3", "--sweep-rho", "0.5,1.0,1.3,2.0",
                                     "--json", str(out), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "clip" in result.output and "noclip" in result.output
    data = json.loads(out.read_text())
    assert (data["rho"], data["eps"], data["sigma"]) == (1.5, 0.2, 1.0)
    # the A-2 numbers: mean -ρσ/2 with clipping, 0 without; variance ρ²σ²/4 vs ρ²σ²
    assert data["clip"]["mean"] == pytest.approx(-0.75, abs=0.05)
    assert data["clip"]["var"] == pytest.approx(0.5625, abs=0.01)
    for branch in ("clip", "noclip"):
        assert_within_mc_error(data, branch, 1.5, 0.2, 1.0, n)
    assert [r["rho"] for r in data["sweep"]] == [0.5, 1.0, 1.3, 2.0]
    for row in data["sweep"]:
        for branch in ("clip", "noclip"):
            assert_within_mc_error(row, branch, row["rho"], 0.2, 1.0, n)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_clip_bias_sweeps_every_eps_sigma_and_rho_given(tmp_path):
    """SPEC 3.3's sweep over ρ, ε and σ from the command line (only ρ could be swept there): every combination,
    each against its closed form within five standard errors."""
    import json

    out = tmp_path / "cb.json"
    result = runner.invoke(sim_app, ["clip-bias", "--samples", "4000", "--sweep-rho", "0.5,2", "--sweep-eps",
                                     "0.1,0.3", "--sweep-sigma", "1,2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    swept = json.loads(out.read_text())["sweep"]
    assert sorted((r["eps"], r["sigma"], r["rho"]) for r in swept) == sorted(
        (e, s, r) for e in (0.1, 0.3) for s in (1.0, 2.0) for r in (0.5, 2.0))
    for r in swept:
        exact, mc, se = r["closed_form"]["clip"], r["clip"], r["stderr"]["clip"]
        assert abs(mc["mean"] - exact["mean"]) <= 5 * se["mean"] + 1e-12
    bad = runner.invoke(sim_app, ["clip-bias", "--samples", "10", "--sweep-eps", "0.1,1.5"])
    assert bad.exit_code == 2 and "--sweep-eps: every ε must be in [0, 1), got 1.5" in bad.output


def test_clip_bias_bad_input_exits_with_message(tmp_path):
    result = runner.invoke(sim_app, ["clip-bias", "--eps", "1.5", "--samples", "10"])
    assert result.exit_code == 2 and "eps" in result.output
    result = runner.invoke(sim_app, ["clip-bias", "--sweep-rho", "1,x", "--samples", "10"])
    assert result.exit_code == 2 and "--sweep-rho" in result.output
    for args, option in ((["--rho", "1e36"], "--rho"), (["--sweep-rho", "1,1e-36"], "--sweep-rho")):
        result = runner.invoke(sim_app, ["clip-bias", *args, "--samples", "10"])
        assert result.exit_code == 2 and f"{option}: |log ρ| must be below 80" in result.output, result.output


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kv4rl.data.char_tokenizer import build_char_tokenizer
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("cli-ckpt")
    tokenizer = build_char_tokenizer(path)
    make_checkpoint(path, vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    return path


def test_correction_variance_writes_one_entry_per_horizon(checkpoint, tmp_path):
    out, png = tmp_path / "cv.json", tmp_path / "cv.png"
    args = ["correction-variance", "--model", str(checkpoint), "--behavior", "stale:1",
            "--horizons", "1,2,full", "--n-prompts", "2", "--samples-per-prompt", "2",
            "--max-new-tokens", "5", "--device", "cpu", "--stale-lr", "1e-2",
            "--json", str(out), "--png", str(png)]
    result = runner.invoke(sim_app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["behavior"] == "stale:1" and data["n_responses"] == 4
    assert [r["horizon"] for r in data["horizons"]] == [1, 2, "full"]
    assert all(r["var"] >= 0 and r["n_tokens"] == data["n_tokens"] for r in data["horizons"])
    # H = 1 is c_t itself
    assert data["horizons"][0]["var"] == pytest.approx(data["log_ratio"]["var"], rel=1e-9)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_correction_variance_bad_behavior_exits_with_message(checkpoint):
    result = runner.invoke(sim_app, ["correction-variance", "--model", str(checkpoint), "--behavior", "fp16"])
    assert result.exit_code == 2 and "--behavior" in result.output


def test_a_refused_correction_variance_makes_no_output_folders(checkpoint, tmp_path):
    """A --data file the measurement refuses (too short for its distinct prompts) fails before any output
    exists: the --json and --png folders are made by the writers, after the work, not by the option checks."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"problem": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(3)))
    out = tmp_path / "new" / "deeper" / "cv.json"
    png = tmp_path / "figs" / "cv.png"
    result = runner.invoke(sim_app, ["correction-variance", "--model", str(checkpoint), "--behavior", "stale:0",
                                     "--data", str(data), "--template", "{problem}=", "--n-prompts", "4",
                                     "--device", "cpu", "--json", str(out), "--png", str(png)])
    assert result.exit_code != 0 and "fewer than" in result.output, result.output
    assert not (tmp_path / "new").exists() and not (tmp_path / "figs").exists()
    # a folder that cannot be made is still refused before the work
    (tmp_path / "file").write_text("")
    result = runner.invoke(sim_app, ["clip-bias", "--samples", "10", "--json", str(tmp_path / "file" / "x.json")])
    assert result.exit_code != 0 and "is a file" in result.output, result.output


def test_no_sim_output_may_replace_a_runs_records(tmp_path):
    """`sim clip-bias --json <run>/metrics.jsonl` replaced the run's training log with the sim's numbers (the check
    of a run's records was in plot, eval and build-model only; it is now in every output path's check)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_000001").mkdir(parents=True)
    (run / "config.yaml").write_text("name: run\n")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for target, said in ((run / "metrics.jsonl", "is the metrics.jsonl of the run in"),
                         (run / "checkpoints" / "iter_000001" / "x.json", "is inside the checkpoints/ of run")):
        result = runner.invoke(sim_app, ["clip-bias", "--samples", "10", "--json", str(target)])
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
