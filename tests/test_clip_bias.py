"""The A-2 simulation: Monte-Carlo moments against the closed forms derived in its docstring."""

import pytest

from kv4rl.sim import clip_bias, closed_form, plot, sweep


def _within(result, branch, stat, num_se=5.0):
    exact = result["closed_form"][branch][stat]
    se = result["stderr"][branch][stat]
    # the sample variance of a two-point law deviates by O(1/n) even when its stderr is ~0
    slack = 25 * abs(exact) / result["n_samples"] if stat == "var" else 0.0
    return abs(result[branch][stat] - exact) <= num_se * se + slack


@pytest.mark.parametrize("rho, regime", [(1.5, "above"), (1.1, "inside"), (0.9, "inside"), (0.5, "below")])
def test_monte_carlo_matches_closed_form(rho, regime):
    result = clip_bias(rho, eps=0.2, sigma=1.0, n_samples=50_000, seed=3)
    assert result["closed_form"]["regime"] == regime
    for branch in ("clip", "noclip"):
        for stat in ("mean", "var"):
            assert _within(result, branch, stat), (branch, stat, result)


def test_closed_forms_by_hand():
    above = closed_form(1.5, 0.2, 1.0)
    assert above["clip"] == {"mean": -0.75, "var": 0.5625}
    assert above["noclip"] == {"mean": 0.0, "var": 2.25}
    assert above["clip_mean_per_unit_ratio"] == -0.5
    below = closed_form(0.5, 0.2, 2.0)
    assert below["clip"] == {"mean": 0.5, "var": 0.25}
    assert str(closed_form(1.5, 0.2, 0.0)["clip"]["mean"]) == "0.0"  # was -0.0 in the JSON
    inside = closed_form(1.1, 0.2, 2.0)
    assert inside["clip"] == inside["noclip"] == {"mean": 0.0, "var": pytest.approx(4.84)}


def test_default_a2_numbers():
    result = clip_bias(1.5, 0.2, 1.0)
    assert result["clip"]["mean"] == pytest.approx(-0.75, abs=5 * result["stderr"]["clip"]["mean"])
    assert result["clip"]["var"] == pytest.approx(0.5625, rel=1e-3)
    assert result["noclip"]["mean"] == pytest.approx(0.0, abs=5 * result["stderr"]["noclip"]["mean"])
    assert result["noclip"]["var"] == pytest.approx(2.25, rel=1e-3)


def test_sweep_and_plot(tmp_path):
    results = sweep([0.5, 1.0, 1.5], eps=[0.1, 0.2], sigma=1.0, n_samples=2_000)
    assert [(r["eps"], r["rho"]) for r in results] == [(e, r) for e in (0.1, 0.2) for r in (0.5, 1.0, 1.5)]
    assert all(_within(r, b, s) for r in results for b in ("clip", "noclip") for s in ("mean", "var"))
    path = plot(results, tmp_path / "fig" / "a2.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs", [{"rho": 0.0}, {"eps": 1.0}, {"sigma": -1.0}, {"n_samples": 1}])
def test_bad_arguments(kwargs):
    args = {"rho": 1.5, "eps": 0.2, "sigma": 1.0, "n_samples": 100} | kwargs
    with pytest.raises(ValueError):
        clip_bias(**args)


def test_a_ratio_past_the_losss_log_ratio_limit_is_refused_not_reported_as_zero():
    """Past |log ρ| = 80 the loss passes no gradient: ρ = 1e36 gave a clipped mean of 0 beside the exact
    -σ/2 per unit ratio, exit 0. Just inside the limit the Monte Carlo still equals the closed form."""
    import math

    for rho in (1e36, 1e-36):
        with pytest.raises(ValueError, match="rho: \\|log ρ\\| must be below 80"):
            clip_bias(rho, 0.2, 1.0, n_samples=100)
    for rho in (math.exp(79.5), math.exp(-79.5)):
        result = clip_bias(rho, 0.2, 1.0, n_samples=100)
        exact = result["closed_form"]["clip_mean_per_unit_ratio"]  # ∓σ/2
        assert result["clip"]["mean"] / rho == pytest.approx(exact, abs=0.2)
        assert result["clip"]["mean"] != 0


def test_each_result_records_the_seed_that_reproduces_it(tmp_path):
    """The JSON held no seed, and the sweep's points use seed + 1 + i: each result names its own, and the
    same seed gives the same draws."""
    from typer.testing import CliRunner

    from kv4rl.cli import app

    results = sweep([0.5, 1.5], eps=0.2, sigma=1.0, n_samples=1_000, seed=7)
    assert [r["seed"] for r in results] == [7, 8]
    assert clip_bias(1.5, 0.2, 1.0, 1_000, seed=8) == results[1]
    res = CliRunner().invoke(app, ["sim", "clip-bias", "--samples", "1000", "--json", str(tmp_path / "a.png"),
                                   "--png", str(tmp_path / "a.png")])
    assert res.exit_code == 2 and "--json" in res.output and not (tmp_path / "a.png").exists()
