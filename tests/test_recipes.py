"""Every recipe under `recipes/` is a valid run config; the arms of an ablation differ only in its knob."""

from pathlib import Path

import pytest
import yaml

from kv4rl.config import load_config
from kv4rl.config_loader import to_dict

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FILES = sorted(RECIPES.glob("*.yaml"))

# ablation -> (its files, the dotted keys allowed to differ between them besides `name`)
ABLATIONS = {
    "horizon": (["horizon_h1", "horizon_h64"], {"algo.horizon", "algo.beta"}),
    "importance": (["is_none", "is_token", "is_sequence"], {"algo.is_mode"}),
    "clip_width": (["clip_eps0.1", "clip_eps0.2", "clip_eps0.2_high0.28"], {"algo.eps_low", "algo.eps_high"}),
    "cost_clip": (["future_cost_clip_off", "future_cost_clip_on"], {"algo.future_cost_clip"}),
    "baseline": (["baseline_clean", "baseline_perturbed"], {"advantage.baseline_noise"}),
    "lr": (["lr_3e-5", "lr_1e-4", "lr_3e-4", "lr_1e-3"], {"trainer.lr"}),
    "staleness_future_kl": (["staleness4_future_kl", "staleness16_future_kl"], {"staleness.lag"}),
    "staleness_ppo_clip": (["staleness4_ppo_clip", "staleness16_ppo_clip"], {"staleness.lag"}),
    "loss_at_staleness16": (["staleness16_future_kl", "staleness16_ppo_clip"], {"algo.loss"}),
}
STALENESS = {"staleness4_future_kl": 4, "staleness4_ppo_clip": 4,
             "staleness16_future_kl": 16, "staleness16_ppo_clip": 16}


def load_recipe(stem: str):
    return load_config(RECIPES / f"{stem}.yaml")


def flat(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        out.update(flat(value, dotted + ".") if isinstance(value, dict) else {dotted: value})
    return out


# testbed recipes: RL on a testbed model (`kv4rl build-model`) -> the testbed it names
TESTBEDS = {"testbed_longmul_gpu": "longmul-gpu", "testbed_longmul_test": "longmul-test"}


# the source papers' real-model settings (weights and data paths named in the file, not shipped)
PAPERS = {"paper_b_qwen3_4b_base_math_kv4_partial", "paper_a_qwen3_8b_refresh64_fp8_future_kl",
          "paper_a_qwen3_1p7b_staleness16_future_kl"}
# what each paper recipe must keep: (dotted key, value)
PAPER_SETTINGS = {
    "paper_b_qwen3_4b_base_math_kv4_partial": {"engine.kv.format": "kv4", "engine.kv.n_sink": 16,
                                               "engine.kv.n_recent": 128, "rollout.mode": "partial"},
    "paper_a_qwen3_8b_refresh64_fp8_future_kl": {"engine.weight_format": "fp8", "staleness.refresh_every": 64,
                                                 "algo.loss": "future_kl", "algo.beta": 0.3,
                                                 "data.chat_template": True},  # chat models want their template
    "paper_a_qwen3_1p7b_staleness16_future_kl": {"staleness.lag": 16, "algo.loss": "future_kl",
                                                 "data.chat_template": True},
}


def test_recipes_exist_and_are_all_accounted_for():
    stems = {f.stem for f in FILES}
    expected = {s for files, _ in ABLATIONS.values() for s in files} | set(TESTBEDS) | PAPERS
    assert stems == expected


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(PAPERS))
def test_paper_recipes_run_a_few_iterations_at_a_test_shape(stem, tmp_path, monkeypatch):
    """Each paper recipe keeps its settings and trains (2 iterations) with its model and data swapped for a
    random-init Qwen3 of the test shape and a few MATH-style rows, on the CPU."""
    from kv4rl.bench.random_model import make_random_qwen3
    from kv4rl.loop import train

    cfg = flat(to_dict(load_config(RECIPES / f"{stem}.yaml")))
    for key, value in PAPER_SETTINGS[stem].items():
        assert cfg[key] == value, key
    model = make_random_qwen3(tmp_path / "model", "qwen3-tiny")
    rows = tmp_path / "math.jsonl"
    rows.write_text("".join(f'{{"problem": "What is {a}+{a}?", "answer": "{2 * a}"}}\n' for a in range(6)))
    monkeypatch.chdir(tmp_path)
    small = [f"model.path={model}", f"data.train={rows}", f"data.eval={rows}", "data.eval_size=2", "device=cpu",
             "rollout.quota_groups=2", "rollout.group_size=2", "rollout.max_slots=4", "rollout.max_new_tokens=6",
             "trainer.iterations=2", "trainer.offload=false", "trainer.max_tokens_per_micro_batch=256",
             "engine.kv.group_size=32", "engine.kv.n_sink=2", "engine.kv.n_recent=4", "eval.every=0",
             "checkpoint.save_every=1", "logging.tensorboard=false",
             "data.chat_template=false"]  # the random model's tokenizer has no chat template
    summary = train(load_config(RECIPES / f"{stem}.yaml", small), show_progress=False)
    assert summary["iterations"] == 2


@pytest.mark.parametrize("stem", sorted(TESTBEDS))
def test_testbed_recipes_train_on_their_testbed(stem):
    cfg = load_recipe(stem)
    assert cfg.model.testbed == TESTBEDS[stem] and cfg.model.path is None and cfg.data.train is None
    assert cfg.device == ("cuda" if TESTBEDS[stem].endswith("gpu") else "cpu")
    if stem == "testbed_longmul_gpu":
        assert cfg.rollout.max_new_tokens == 2048  # never cuts a worked solution (tests/test_longmul.py)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_recipe_loads_as_a_run_config(path):
    raw = yaml.safe_load(path.read_text())
    cfg = load_recipe(path.stem)
    assert cfg.name == raw["name"]  # runs go to runs/<name>, named in the file


def test_names_are_distinct():
    names = [yaml.safe_load(f.read_text())["name"] for f in FILES]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_arms_differ_only_in_the_ablated_knob(ablation):
    stems, knobs = ABLATIONS[ablation]
    configs = [flat(to_dict(load_recipe(s))) for s in stems]
    differing = {k for k in configs[0] if len({repr(c[k]) for c in configs}) > 1}
    assert differing == knobs | {"name"}


def test_ablation_values_match_the_figures():
    by_stem = {s: load_recipe(s) for files, _ in ABLATIONS.values() for s in files}
    h1, h64 = by_stem["horizon_h1"].algo, by_stem["horizon_h64"].algo
    assert (h1.horizon, h64.horizon) == (1, 64)
    assert h1.beta * h1.horizon == pytest.approx(4.8) and h64.beta * h64.horizon == pytest.approx(4.8)
    for stem in ("is_none", "is_token", "is_sequence", "future_cost_clip_off", "baseline_clean"):
        algo = by_stem[stem].algo
        assert (algo.loss, algo.horizon, algo.beta) == ("future_kl", "full", 0.3)
    modes = [by_stem[s].algo.is_mode for s in ("is_none", "is_token", "is_sequence")]
    assert modes == ["none", "token", "sequence"]
    assert by_stem["future_cost_clip_on"].algo.future_cost_clip == 1.0
    assert by_stem["baseline_perturbed"].advantage.baseline_noise > 0
    assert by_stem["clip_eps0.2_high0.28"].algo.eps_high == 0.28
    assert all(by_stem[s].algo.loss == "ppo_clip" for s in ABLATIONS["clip_width"][0] + ABLATIONS["lr"][0])
    # the figures' staleness: 16 for A-6, 4 for every other ablation
    for stem, cfg in by_stem.items():
        expected = STALENESS.get(stem, 16 if stem.startswith("is_") else 4)
        assert cfg.staleness.lag == expected, stem


@pytest.mark.parametrize("stem", sorted(STALENESS))
def test_staleness_recipes_set_the_lag(stem):
    raw = yaml.safe_load((RECIPES / f"{stem}.yaml").read_text())
    assert raw["staleness"]["lag"] == STALENESS[stem]
    assert raw["algo"]["loss"] == stem.split("_", 1)[1]
    assert load_recipe(stem).staleness.lag == STALENESS[stem]


def test_readme_lists_every_recipe():
    readme = (RECIPES / "README.md").read_text()
    for path in FILES:
        assert f"`{path.name}`" in readme, path.name
