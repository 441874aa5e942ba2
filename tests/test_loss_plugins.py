"""Losses as plug-ins: a loss registered outside the package trains via `algo.loss`, gets exactly
the inputs it declares, owns its `algo.*` keys; unknown names and clashing keys are clear errors."""

import json
import logging
import os
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import kv4rl
from kv4rl.algo.aggregation import aggregate
from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.registry import LOSS_INPUTS, LOSSES, LossInputs, register_loss
from kv4rl.cli import app
from kv4rl.config import ConfigError, load_config, save_config
from kv4rl.config_loader import to_dict
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner


@dataclass(kw_only=True)
class ToySettings:
    toy_scale: float = 1.0

    def validate(self) -> None:
        if not self.toy_scale > 0:
            raise ValueError(f"algo.toy_scale must be > 0, got {self.toy_scale}")


SEEN: list[dict] = []  # per call of the toy loss: which optional inputs it got, and their values


@pytest.fixture
def toy_loss():
    """REINFORCE scaled by `algo.toy_scale`, reading per-token versions and the pre-update log-probs."""

    @register_loss("toy_pg", settings=ToySettings, inputs={"versions", "old_logprobs"})
    def toy_pg(inp: LossInputs, cfg: AlgoConfig):
        valid = inp.valid_mask()
        SEEN.append({name: getattr(inp, name) for name in LOSS_INPUTS} | {"logprobs": inp.logprobs.detach()})
        adv = torch.where(valid, inp.advantages, 0)
        loss = -cfg.section("toy_pg").toy_scale * aggregate(adv * inp.logprobs, valid, cfg.loss_agg, inp.num_tokens)
        return loss, {"toy_version_max": float(inp.need("versions").max())}

    SEEN.clear()
    yield "toy_pg"
    del LOSSES["toy_pg"]


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 2, 5)]
    versions = [[7] * 4, [5, 6], [7, 7, 8, 8, 8]]
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], versions, [1.0, -0.5, 0.3], 0)


def _learner(path, algo):
    """A learner given a reference checkpoint: whether it loads it is up to the loss."""
    learner = Learner(path, path, algo=algo, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                      micro_batch_size=2, updates_per_batch=1, temperature=1.0, device=torch.device("cpu"))
    learner.extra_forwards = 0
    inner = learner._logprobs

    def counted(model, batch):
        learner.extra_forwards += 1
        return inner(model, batch)

    learner._logprobs = counted
    return learner


def test_a_loss_registered_outside_gets_exactly_its_declared_inputs(tiny_qwen3, toy_loss):
    path, _ = tiny_qwen3
    algo = load_config(overrides=[f"algo.loss={toy_loss}", "algo.toy_scale=2.0"]).algo
    assert algo.section(toy_loss).toy_scale == 2.0 and algo.toy_scale == 2.0
    learner = _learner(path, algo)
    assert learner.ref_model is None  # the toy does not read ref_logprobs, so no reference model
    b = _batch()
    metrics = learner.step(b)
    assert learner.extra_forwards == 1  # old_logprobs only
    assert len(SEEN) == 2  # two micro-batches of 2 and 1 rows
    for seen in SEEN:
        given = {name for name in LOSS_INPUTS if seen[name] is not None}
        assert given == {"versions", "old_logprobs"}
        # before the first update, π_old is the policy itself
        torch.testing.assert_close(seen["old_logprobs"], seen["logprobs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([s["versions"] for s in SEEN]), b.versions, rtol=0, atol=0)
    assert metrics["toy_version_max"] == 8.0


def test_a_plugin_setting_reaches_the_loss(tiny_qwen3, toy_loss):
    """toy_scale = 4 scales every gradient of toy_scale = 1 by 4, exactly (a power of two; no clipping)."""
    path, _ = tiny_qwen3
    grads = []
    for scale in (1.0, 4.0):
        learner = _learner(path, AlgoConfig(loss=toy_loss, toy_scale=scale))
        learner.step(_batch())
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters()})
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], 4.0 * grad), name


@pytest.mark.parametrize("overrides, forwards, ref_loaded", [
    (["algo.loss=ppo_clip"], 1, True),  # reference log-probs only
    (["algo.loss=ppo_clip", "algo.old_logprob=recompute"], 2, True),
    (["algo.loss=future_kl"], 1, True),
])
def test_built_in_losses_declare_what_the_learner_computes(tiny_qwen3, overrides, forwards, ref_loaded):
    path, _ = tiny_qwen3
    learner = _learner(path, load_config(overrides=overrides).algo)
    learner.step(_batch())
    assert learner.extra_forwards == forwards
    assert (learner.ref_model is not None) == ref_loaded


@pytest.mark.slow
def test_short_training_run_with_a_plugin_loss(tmp_path, toy_loss):
    from kv4rl.loop import train

    cfg = load_config(overrides=["name=toy", f"out_dir={tmp_path}", "device=cpu", f"algo.loss={toy_loss}",
                                 "algo.toy_scale=0.5", "trainer.iterations=2", "checkpoint.save_every=2",
                                 "rollout.quota_groups=4", "rollout.group_size=4"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert [r["toy_version_max"] for r in rows] == [0.0, 1.0]  # sync rollouts: sampled by the current version
    saved = yaml.safe_load((cfg.run_dir / "config.yaml").read_text())
    assert saved["algo"]["loss"] == toy_loss and saved["algo"]["toy_scale"] == 0.5


def test_plugin_keys_round_trip_through_the_saved_config(tmp_path, toy_loss):
    cfg = load_config(overrides=[f"algo.loss={toy_loss}", "algo.toy_scale=4"])
    save_config(cfg, tmp_path / "c.yaml")
    assert to_dict(load_config(tmp_path / "c.yaml")) == to_dict(cfg)
    with pytest.raises(ConfigError, match=r"algo\.toy_scale must be > 0"):
        load_config(overrides=[f"algo.loss={toy_loss}", "algo.toy_scale=-1"])
    with pytest.raises(ConfigError, match=r"algo\.toy_scale: expected float"):
        load_config(overrides=[f"algo.loss={toy_loss}", "algo.toy_scale=big"])


def test_unregistered_names_and_keys_are_clear_errors(toy_loss):
    with pytest.raises(ConfigError, match=r"algo\.loss: unknown loss 'dpo' \(registered: future_kl, ppo_clip, toy_pg; "):
        load_config(overrides=["algo.loss=dpo"])
    spec = LOSSES.pop(toy_loss)
    try:
        with pytest.raises(ConfigError, match=r"unknown config key 'algo\.toy_scale'"):
            load_config(overrides=["algo.toy_scale=2"])
    finally:
        LOSSES[toy_loss] = spec


def test_unknown_loss_on_the_command_line_exits_2_with_the_registered_names(tmp_path):
    res = CliRunner().invoke(app, ["train", f"out_dir={tmp_path}", "algo.loss=reinforce"])
    assert res.exit_code == 2
    assert "unknown loss 'reinforce'" in res.output and "ppo_clip" in res.output and "future_kl" in res.output
    assert not any(tmp_path.iterdir())  # refused before the run folder was made


def test_loss_is_an_open_name_not_a_closed_literal(toy_loss):
    assert typing.get_type_hints(AlgoConfig.__init__)["loss"] is str
    assert AlgoConfig.config_schema()["loss"] is str
    AlgoConfig(loss=toy_loss).validate()


def test_a_key_of_another_loss_is_warned_about_naming_its_owner(caplog, toy_loss):
    with caplog.at_level(logging.WARNING, logger="kv4rl.config"):
        load_config(overrides=["algo.loss=ppo_clip", "algo.beta=0.5", "algo.toy_scale=2"])
    assert "algo.beta=0.5 belongs to algo.loss=future_kl; algo.loss=ppo_clip ignores it (TRL's beta, the " \
           "reference-KL coefficient, is algo.kl_ref_coef)" in caplog.messages
    assert "algo.toy_scale=2.0 belongs to algo.loss=toy_pg; algo.loss=ppo_clip ignores it" in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv4rl.config"):
        load_config(overrides=["algo.loss=future_kl", "algo.beta=0.5", "algo.eps_low=0.2"])  # a default: silent
    assert caplog.messages == []


def test_registration_refuses_what_would_make_keys_or_inputs_ambiguous(toy_loss):
    @dataclass
    class Clash:
        beta: float = 1.0

    @dataclass
    class Shared:
        loss_agg: str = "x"

    @dataclass
    class NoDefault:
        toy_other: float

    with pytest.raises(ValueError, match=r"'algo\.beta' already belongs to 'future_kl'"):
        register_loss("clash", settings=Clash)
    with pytest.raises(ValueError, match=r"'algo\.loss_agg' already belongs to 'all losses'"):
        register_loss("shared", settings=Shared)
    with pytest.raises(ValueError, match=r"'algo\.toy_other' needs a default"):
        register_loss("nodefault", settings=NoDefault)
    with pytest.raises(ValueError, match=r"unknown inputs \['entropy'\]"):
        register_loss("wants_entropy", inputs={"entropy", "versions"})
    with pytest.raises(ValueError, match="already registered"):
        register_loss(toy_loss)
    with pytest.raises(ValueError, match="identifier"):
        register_loss("my loss")
    assert set(LOSSES) == {"ppo_clip", "future_kl", toy_loss}


def test_kl_ref_coef_needs_a_loss_that_reads_reference_logprobs(toy_loss):
    with pytest.raises(ConfigError, match=r"algo\.kl_ref_coef: algo\.loss=toy_pg does not read reference"):
        load_config(overrides=[f"algo.loss={toy_loss}", "algo.kl_ref_coef=0.1"])
    assert load_config(overrides=["algo.loss=future_kl", "algo.kl_ref_coef=0.1"]).algo.kl_ref_coef == 0.1


PLUGIN_MODULE = """
from dataclasses import dataclass
from pathlib import Path

from kv4rl.algo.registry import register_loss


@dataclass
class Knobs:
    my_knob: float = 1.0


@register_loss("file_loss", settings=Knobs)
def file_loss(inp, cfg):
    return -(inp.advantages * inp.logprobs).sum() * cfg.section("file_loss").my_knob, {}
"""


def test_algo_plugins_imports_the_module_that_registers_a_loss(tmp_path, monkeypatch):
    """`algo.plugins` makes a loss in the user's own file usable from a config, and a saved run
    config that names it loads again in a fresh process (as `--resume` does)."""
    (tmp_path / "file_loss_plugin.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = load_config(overrides=["algo.plugins=[file_loss_plugin]", "algo.loss=file_loss", "algo.my_knob=3"])
        assert cfg.algo.my_knob == 3.0 and cfg.algo.plugins == ["file_loss_plugin"]
        save_config(cfg, tmp_path / "run" / "config.yaml")
    finally:
        LOSSES.pop("file_loss", None)
        sys.modules.pop("file_loss_plugin", None)
    with pytest.raises(ConfigError, match=r"unknown config key 'algo\.my_knob'.*needs that module in algo\.plugins"):
        load_config(overrides=["algo.my_knob=3"])  # without the plugin the key means nothing
    with pytest.raises(ConfigError, match=r"algo\.plugins: cannot import 'no_such_plugin'"):
        load_config(overrides=["algo.plugins=[no_such_plugin]"])
    code = ("from kv4rl.config import load_config; import sys; "
            "a = load_config(sys.argv[1]).algo; print(a.loss, a.my_knob)")
    path = os.pathsep.join([str(tmp_path), str(os.path.dirname(os.path.dirname(kv4rl.__file__)))])
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run" / "config.yaml")], check=True,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
    assert out.stdout.split() == ["file_loss", "3.0"]


def test_a_plugin_that_fails_inside_is_told_apart_from_one_not_found(tmp_path, monkeypatch):
    """A plug-in module found on the path whose own import of a dependency fails is named as found (the
    path hint would send the user to the wrong module), and a settings class without a default is a config
    error (one line from the CLI, exit 2), not a TypeError traceback."""
    (tmp_path / "needs_dep_plugin.py").write_text("import no_such_dependency_xyz  # noqa\n")
    (tmp_path / "no_default_plugin.py").write_text(
        "from dataclasses import dataclass\nfrom kv4rl.algo.registry import register_loss\n\n"
        "@dataclass\nclass S:\n    knob_without_default: float\n\n"
        "@register_loss('no_default_loss', settings=S)\ndef f(inp, cfg):\n    return inp.logprobs.sum(), {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"'needs_dep_plugin' was found, but importing it failed: "
                                              r"No module named 'no_such_dependency_xyz'"):
            load_config(overrides=["algo.plugins=[needs_dep_plugin]"])
        with pytest.raises(ConfigError, match=r"'algo\.knob_without_default' needs a default"):
            load_config(overrides=["algo.plugins=[no_default_plugin]"])
    finally:
        for name in ("needs_dep_plugin", "no_default_plugin"):
            sys.modules.pop(name, None)
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_pkg\.plugin'.*Python path"):
        load_config(overrides=["algo.plugins=[no_such_pkg.plugin]"])


def _readme_loss_module() -> str:
    """The README's "Writing your own loss" example, as a user would copy it."""
    readme = (Path(kv4rl.__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("# my_losses.py\n")
    return readme[start:readme.index("```", start)]


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "token_sum_norm"])
def test_the_readme_example_loss_adds_up_over_micro_batches(tmp_path, monkeypatch, loss_agg):
    """The README's `stale_pg`, loaded through `algo.plugins` as documented: its loss on a batch equals the
    sum over micro-batches of whole rows (full-batch denominators, as the learner passes them), and its
    weights are the hand-worked decay^(age within the row). Its first version took the age from the newest
    version in the micro-batch, so two micro-batches weighted the same tokens differently."""
    (tmp_path / "readme_losses.py").write_text(_readme_loss_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        algo = load_config(overrides=["algo.plugins=[readme_losses]", "algo.loss=stale_pg", "algo.stale_decay=0.5",
                                      f"algo.loss_agg={loss_agg}"]).algo
        fn = LOSSES["stale_pg"].fn
        # rows: versions 5,5 | 3,3,(pad) | 2,3,4 | 4,(pad),(pad); the row ages are 0,0 | 0,0 | 2,1,0 | 0
        versions = torch.tensor([[5, 5, -1], [3, 3, -1], [2, 3, 4], [4, -1, -1]])
        mask = (versions >= 0).float()
        logprobs = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, -0.25, 0.0], [-1.0, -3.0, -0.5], [-0.75, 0.0, 0.0]],
                                dtype=torch.float64, requires_grad=True)
        advantages = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)[:, None].expand(4, 3) * mask
        num_tokens, num_seqs = float(mask.sum()), 4.0

        def run(rows):
            inp = LossInputs(logprobs=logprobs[rows], advantages=advantages[rows], mask=mask[rows],
                             versions=versions[rows], num_tokens=num_tokens, num_seqs=num_seqs, norm_tokens=6.0)
            return fn(inp, algo)

        whole, metrics = run(slice(None))
        parts = run(slice(0, 2))[0] + run(slice(2, 4))[0]
        weights = torch.tensor([[1, 1, 0], [1, 1, 0], [0.25, 0.5, 1], [1, 0, 0]], dtype=torch.float64)
        per_token = -(weights * advantages * logprobs.detach())
        if loss_agg == "token_mean":
            want = per_token.sum() / num_tokens
        elif loss_agg == "token_sum_norm":
            want = per_token.sum() / (num_seqs * 6.0)
        else:
            want = (per_token.sum(1) / mask.sum(1)).sum() / num_seqs
        assert float(whole) == pytest.approx(float(want), rel=1e-12)
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)
        assert metrics["stale_weight_mean"] == pytest.approx(float(weights.sum() / mask.sum()), rel=1e-12)
    finally:
        LOSSES.pop("stale_pg", None)
        sys.modules.pop("readme_losses", None)


def test_registration_refuses_settings_that_would_fail_later():
    """Each trained, or failed with a traceback, until later: a default of another type was written to
    config.yaml and refused by the run's own --resume; a field named `_sections` or `validate` broke the algo
    section; a frozen dataclass could not take an override."""
    import dataclasses

    @dataclass
    class WrongDefault:
        toy_k: float = "oops"

    @dataclass
    class Private:
        _sections: int = 0

    @dataclass
    class Method:
        validate: int = 1

    @dataclass(frozen=True)
    class Frozen:
        toy_fz: float = 0.5

    with pytest.raises(ValueError, match=r"loss 'wrong': the default of setting 'algo\.toy_k' is not of its type "
                                         r"\(algo\.toy_k: expected float, got 'oops'\)"):
        register_loss("wrong", settings=WrongDefault)
    for name, settings in (("private", Private), ("method", Method)):
        field = dataclasses.fields(settings)[0].name
        with pytest.raises(ValueError, match=rf"setting 'algo\.{field}' is named like the algo section's own"):
            register_loss(name, settings=settings)
    with pytest.raises(ValueError, match="must not be a frozen dataclass"):
        register_loss("frozen", settings=Frozen)

    @dataclass
    class Fine:
        toy_fine: float = 0.5

    # an instance passed `is_dataclass`, registered, and then every config's validate() raised a TypeError
    with pytest.raises(ValueError, match=r"loss 'instance': settings must be the dataclass itself, not an instance "
                                         r"of it: settings=Fine"):
        register_loss("instance", settings=Fine())
    assert not {"wrong", "private", "method", "frozen", "instance"} & set(LOSSES)
    from kv4rl.config import load_config

    load_config(None, [])  # every registered loss's settings still build


@pytest.mark.parametrize(("source", "said"), [
    ("def broken(:\n", r"importing 'kv4rl_test_bad_plugin' failed: SyntaxError: .*kv4rl_test_bad_plugin\.py, line 1"),
    ("x = undefined_name + 1\n", r"importing 'kv4rl_test_bad_plugin' failed: NameError: name 'undefined_name' is not "
                                r"defined \(.*kv4rl_test_bad_plugin\.py, line 1\)"),
    ("raise RuntimeError('plugin init failed')\n", r"importing 'kv4rl_test_bad_plugin' failed: RuntimeError: plugin "
                                                   r"init failed \(.*kv4rl_test_bad_plugin\.py, line 1\)"),
])
def test_a_plugin_whose_own_code_fails_on_import_is_one_error_naming_it(tmp_path, monkeypatch, source, said):
    """Only an ImportError was caught; a SyntaxError, NameError or any error of the module's own code was a
    traceback."""
    from kv4rl.algo.registry import import_plugins

    (tmp_path / "kv4rl_test_bad_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kv4rl_test_bad_plugin", raising=False)
    with pytest.raises(ValueError, match="^algo.plugins: " + said):
        import_plugins(["kv4rl_test_bad_plugin"])


@pytest.mark.parametrize(("returned", "said"), [
    (lambda g: g.sum(), r"returned Tensor; it must return \(loss, metrics\)"),
    (lambda g: (g * 1.0, {}), r"returned a tensor of shape \(2, 3\) as its loss"),
    (lambda g: (g.sum().detach(), {}), "returned a tensor without a gradient"),
    (lambda g: (1.5, {}), "returned float as its loss"),
    (lambda g: (g.sum(), {"grad_norm": 123.0}), "returned a metric 'grad_norm', a name the learner logs itself"),
    (lambda g: (g.sum(), {"mine": "text"}), "returned metric 'mine' = 'text'; a metric must be a number"),
    (lambda g: (g.sum(), [1.0]), "returned metrics of type list; they must be a dict"),
])
def test_a_loss_that_returns_what_the_learner_cannot_use_is_named(returned, said):
    """Each failed deep in backward() or the metric merge with a traceback, or (a metric named `grad_norm`)
    was averaged into the real gradient norm without a word."""
    from kv4rl.algo.registry import LossSpec

    spec = LossSpec("odd", lambda inp, cfg: returned(torch.ones(2, 3, requires_grad=True)))
    with pytest.raises(ValueError, match=f"^loss 'odd' {said}"):
        spec(None, None)
    fine = LossSpec("fine", lambda inp, cfg: (torch.ones(2, 3, requires_grad=True).sum(), {"mine": 1.0,
                                                                                           "t": torch.tensor(2.0)}))
    assert fine(None, None)[1] == {"mine": 1.0, "t": torch.tensor(2.0)}


def test_a_nan_loss_with_a_finite_gradient_is_warned_of(tiny_qwen3, caplog):
    """`loss * 0 + nan` has a zero gradient, so the step was taken and the row logged `loss: null` with no word."""
    path, _ = tiny_qwen3

    @register_loss("nan_pg")
    def nan_pg(inp: LossInputs, cfg: AlgoConfig):
        return inp.logprobs.sum() * 0.0 + float("nan"), {}

    try:
        learner = _learner(path, AlgoConfig(loss="nan_pg"))
        with caplog.at_level(logging.WARNING):
            metrics = learner.step(_batch())
    finally:
        del LOSSES["nan_pg"]
    assert metrics["skipped_steps"] == 0 and metrics["grad_norm"] == 0.0
    assert [m for m in caplog.messages if "loss was not finite" in m] == [
        "iteration 0: the loss was not finite in 2 micro-batch(es) (logged as null); check the loss (algo.loss=nan_pg)"]
