"""Config loading: YAML + dotted overrides into typed dataclasses; errors name the key."""

import logging
import re

from pathlib import Path

import pytest
import yaml

from kv4rl.config import ConfigError, RunConfig, load_config, save_config
from kv4rl.config_loader import to_dict


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, RunConfig) and cfg.rollout.group_size == 8
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert to_dict(again) == to_dict(cfg)


def test_yaml_then_overrides_take_precedence(tmp_path):
    (tmp_path / "my.yaml").write_text(yaml.safe_dump({"trainer": {"lr": 0.5, "iterations": 3},
                                                      "algo": {"horizon": 64}}))
    cfg = load_config(tmp_path / "my.yaml", ["trainer.lr=1e-5", "rollout.group_size=4", "model.path=null",
                                             "trainer.betas=[0.8, 0.9]", "engine.prefix_sharing=false"])
    assert cfg.trainer.lr == 1e-5 and cfg.trainer.iterations == 3
    assert cfg.rollout.group_size == 4 and cfg.algo.horizon == 64 and cfg.model.path is None
    assert cfg.trainer.betas == (0.8, 0.9)
    assert cfg.engine.prefix_sharing is False and load_config().engine.prefix_sharing is True


@pytest.mark.parametrize("override,needle", [
    ("trainer.lrr=1", "trainer.lrr"),
    ("nosuch.x=1", "nosuch"),
    ("trainer.lr=fast", "trainer.lr"),
    ("rollout.group_size=2.5", "rollout.group_size"),
    ("data.shuffle=3", "data.shuffle"),
    ("algo.loss=dpo", "algo.loss"),
    ("engine.kv.format=int3", "engine.kv.format"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.top_k=-5", "rollout.top_k must be >= 0"),
    ("rollout.min_p=1.5", r"rollout.min_p must be in \[0, 1\] \(0: off\), got 1.5"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay must be >= 0"),
    ("trainer.weight_decay=1e4", "trainer.lr x trainer.weight_decay must be < 1, got 0.0001 x 10000"),
    ("trainer.betas=[1.0,0.999]", "trainer.betas must each be in"),
    ("trainer.updates_per_batch=300", "trainer.updates_per_batch=300 optimizer steps need at least as many"),
    ("rollout.temperature=1e-9", "rollout.temperature must be at least 1e-05"),
    ("eval.temperature=-1", "eval.temperature must be 0 \\(greedy\\) or at least"),
    ("algo.eps_low=1.5", "algo.eps_low"),
    ("trainer.betas=[0.9]", "trainer.betas"),
    ("data.prompt_template=hello", "data.prompt_template"),
    ("trainer=3", "trainer"),
    ("engine.prefix_sharing=3", "engine.prefix_sharing"),
    ("engine.tensor_parallel=0", "engine.tensor_parallel"),
    ("telemetry.attribution_every=-1", "telemetry.attribution_every"),
    ("telemetry.attribution_samples=0", "telemetry.attribution_samples"),
    ("device=cuda:x", "device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ("trainer.lr=inf", "trainer.lr: expected a finite number, got 'inf'"),
    ("trainer.lr=-Infinity", "trainer.lr: expected a finite number"),
    ("trainer.grad_clip=nan", "trainer.grad_clip: expected a finite number"),
    ("algo.dual_clip=.nan", "algo.dual_clip: expected a finite number, got nan"),  # a float | null key said
    ("algo.future_cost_clip=.inf", "algo.future_cost_clip: expected a finite number, got inf"),  # "not of type"
    ("algo.dual_clip=abc", "algo.dual_clip: 'abc' is not of type float \\| null"),
    ("device=cudax", "device must be"),
    ("reward.name=bogus", "reward.name: unknown reward 'bogus'; known: auto, boxed_format, exact, math_verify"),
    ("data.prompt_template='{problem:d}'", "data.prompt_template: '{problem:d}' does not format a problem"),
    ("data.prompt_template='{problem!x}'", "data.prompt_template: '{problem!x}' does not format a problem"),
])
def test_bad_keys_values_and_combinations_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(overrides=[override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(overrides=["trainer.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.parametrize(("content", "needle"), [
    ("", "holds no settings"),
    ("# only a comment\n", "holds no settings"),
    ("name: a\ntrainer: {lr: 1.0e-5}\nname: b\n", "key 'name' is given twice in one mapping (line 3, column 1)"),
    ("trainer:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", "key 'lr' is given twice"),
    ("trainer: {iterations: [\n", "is not valid YAML: "),
    (b"\xffname: a\n", "is not UTF-8 text"),
    ("trainer:\n  lr: .inf\n", "trainer.lr: expected a finite number"),
    ("trainer:\n  grad_clip: .nan\n", "trainer.grad_clip: expected a finite number"),
    ("trainer:\n  iterations: 010\n", "'010' is read by YAML as 8, not as written"),
    ("trainer:\n  iterations: 1:40\n", "'1:40' is read by YAML as 100, not as written"),
    ("? [a, b]\n: 1\n", "a key must be a name, not a list (line 1, column 3)"),  # was a TypeError traceback
    # YAML reads these keys unquoted as numbers, booleans (YAML 1.1's on/off/yes/no too) and null: a traceback before
    ("1: 2\n", "a key must be a name, not 1 (quote it if it is one) (line 1, column 1)"),
    ("trainer: {on: 2}\n", "a key must be a name, not True (quote it if it is one) (line 1, column 11)"),
    ("trainer:\n  null: 1\n", "a key must be a name, not null (quote it if it is one) (line 2, column 3)"),
    ("checkpoint:\n  <<: {save_every: 5}\n  <<: {keep_last: 2}\n", "key '<<' is given twice in one mapping"),
])
def test_a_config_file_that_would_be_misread_names_the_file_and_the_problem(tmp_path, content, needle):
    path = tmp_path / "c.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    if "trainer." not in needle:
        assert str(path) in message
def test_a_wrong_value_is_shown_cut_short_in_its_message(tmp_path):
    """A long list from a YAML alias in one key made a 5 MB error line (the value's whole repr): the message now
    shows the value's head (12 items, 200 characters of a string) and still names the key and the type."""
    path = tmp_path / "c.yaml"
    path.write_text("big: &big [" + ", ".join(str(i) for i in range(100_000)) + "]\ntrainer:\n  lr: *big\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "trainer.lr: expected float, got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...]" in message, message[:300]
    assert len(message) < 1000
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.lr=" + "x" * 10_000])
    assert "trainer.lr" in str(info.value) and "x" * 90 in str(info.value) and len(str(info.value)) < 1000




def test_a_folder_given_as_the_config_file_is_named_as_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; give a YAML file"):
        load_config(tmp_path)


def test_an_override_into_a_key_the_file_set_to_a_value_names_both(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["trainer.iterations=1"])
    assert "'trainer' is already the value 5 (from the config file or an earlier override)" in str(info.value)
    with pytest.raises(ConfigError, match="'trainer.lr' is already the value 0.1"):
        load_config(None, ["trainer.lr=0.1", "trainer.lr.x=1"])


@pytest.mark.parametrize("text, value", [("010", 8), ("0100", 64), ("1:40", 100), ("-07", -7), ("0b11", 3)])
def test_a_yaml11_integer_that_means_another_number_is_refused(text, value):
    """YAML 1.1 reads a leading zero as octal and `a:b` as base 60: `trainer.iterations=010` trained 8."""
    assert yaml.safe_load(text) == value  # what plain YAML makes of it
    with pytest.raises(ConfigError, match=f"trainer.iterations: '{text}' is read by YAML as {value}, not as written"):
        load_config(overrides=[f"trainer.iterations={text}"])


@pytest.mark.parametrize("text, value", [("10", 10), ("0", 0), ("-3", -3), ("+4", 4), ("1_000", 1000),
                                         ("0x10", 16)])
def test_plain_integers_read_as_written(text, value):
    assert load_config(overrides=[f"seed={text}"]).seed == value
    assert load_config(overrides=[f"name='{text}'"]).name == text  # quoted: text


def test_model_and_data_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """config.yaml held `data/t.jsonl` as typed, so `--resume` from another folder read that folder's file."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["model.path=m", "data.train=data/t.jsonl", "data.eval=../e.jsonl"])
    assert (cfg.model.path, cfg.data.train, cfg.data.eval) == (
        str(tmp_path / "m"), str(tmp_path / "data" / "t.jsonl"), str(tmp_path.parent / "e.jsonl"))
    save_config(cfg, tmp_path / "config.yaml")
    monkeypatch.chdir(tmp_path.parent)
    assert load_config(tmp_path / "config.yaml").data.train == str(tmp_path / "data" / "t.jsonl")


def test_yaml_merge_keys_bring_a_base_mapping_and_the_keys_beside_them_win(tmp_path):
    """`<<: *anchor` was refused as "could not determine a constructor for the tag ...merge"."""
    path = tmp_path / "c.yaml"
    path.write_text("rollout: &shared {quota_groups: 3, group_size: 4}\n"
                    "eval:\n  <<: *shared\n  every: 2\n  k: 5\n  quota_groups: 7\n")
    with pytest.raises(ConfigError, match="eval.*quota_groups"):  # the merged keys are checked like any others
        load_config(path)
    path.write_text("trainer: &t {iterations: 3, lr: 1.0e-4}\n"
                    "rollout:\n  quota_groups: 2\n  group_size: 2\n"
                    "checkpoint:\n  <<: {save_every: 5, keep_last: 2}\n  keep_last: 4\n")
    cfg = load_config(path)
    assert (cfg.trainer.iterations, cfg.checkpoint.save_every, cfg.checkpoint.keep_last) == (3, 5, 4)


def test_a_key_given_twice_in_the_overrides_takes_the_last_value():
    """As a script that appends overrides to a command expects (the README commands' test does)."""
    assert load_config(None, ["trainer.lr=1e-3", "trainer.lr=1e-5"]).trainer.lr == 1e-5


@pytest.mark.parametrize(("override", "needle"), [
    ("seed=18446744073709551616", "seed must be in [-2**63, 2**64) (torch's seed range), got 18446744073709551616"),
    ("seed=100000000000000000000000", "seed must be in [-2**63, 2**64)"),  # was "Overflow when unpacking long long"
    ("seed=-9223372036854775809", "seed must be in [-2**63, 2**64)"),
    ("out_dir=", "out_dir is empty"),  # trained into the current folder
    ("model.path=", "model.path is empty"),  # reported as "error: .: config.json is missing"
    ("data.train=", "data.train is empty"),
    ("data.eval=", "data.eval is empty"),
])
def test_values_that_were_taken_or_failed_late_are_refused_by_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_the_edges_of_the_values_refused_are_taken():
    """Every seed torch takes trains (a run folder of an earlier version may hold any of them)."""
    assert load_config(None, ["seed=18446744073709551615"]).seed == 2**64 - 1
    assert load_config(None, ["seed=-9223372036854775808"]).seed == -(2**63)


def test_a_lag_at_or_past_the_run_length_is_told_what_it_collects(caplog):
    """staleness.lag=1000 with one iteration ran ~1,000 collections (18 s) for one update without a word."""
    with caplog.at_level("WARNING"):
        load_config(None, ["staleness.lag=3", "trainer.iterations=4"])
    assert not [m for m in caplog.messages if "staleness.lag" in m]
    with caplog.at_level("WARNING"):
        load_config(None, ["staleness.lag=1000", "trainer.iterations=1"])
    assert [m for m in caplog.messages if "staleness.lag" in m] == [
        "staleness.lag=1000 collects 1000 batches ahead of the learner: with trainer.iterations=1 the run collects "
        "1001 and trains on 1 (the rest wait in its checkpoint for a longer --resume)"]
    caplog.clear()
    with caplog.at_level("WARNING"):  # a split run's engines hold theirs outside any checkpoint
        load_config(None, ["staleness.lag=3", "trainer.iterations=2", "rollout.placement=split"])
    assert [m for m in caplog.messages if "staleness.lag" in m] == [
        "staleness.lag=3 collects 3 batches ahead of the learner: with trainer.iterations=2 the run collects up to 5 "
        "and trains on 2 (the rest are dropped; a longer --resume samples them again)"]


@pytest.mark.parametrize(("override", "suggested"), [
    ("lr=1e-5", "unknown config key 'lr'; did you mean trainer.lr?"),  # a key one section too high
    # another framework's name: its kv4rl key, not a look-alike (TRL's `beta` was pointed to algo.beta)
    ("beta=0.04", "unknown config key 'beta'; TRL's beta (the reference-KL coefficient) is algo.kl_ref_coef; "
                  "algo.beta is future_kl's future-KL cost"),
    ("algo.loss_type=dr_grpo", "unknown config key 'algo.loss_type'; TRL's loss_type is algo.loss_agg (dapo: "
                               "token_mean, grpo: seq_mean, dr_grpo: token_sum_norm; cispo: token_mean with "
                               "algo.surrogate=cispo, sapo: seq_mean with algo.surrogate=sapo, vespo: token_mean "
                               "with algo.surrogate=vespo; luspo: seq_mean_token_sum with algo.ratio_level=sequence)"),
    ("trainer.num_iterations=2", "unknown config key 'trainer.num_iterations'; TRL's num_iterations is "
                                 "trainer.epochs_per_batch (with algo.old_logprob=recompute)"),
    ("delta=3", "unknown config key 'delta'; TRL's delta is algo.dual_clip"),
    ("min_p=0.1", "unknown config key 'min_p'; TRL's and vLLM's min_p is rollout.min_p"),
    ("reward.reward_weights=[1,2]", "unknown config key 'reward.reward_weights'; TRL's reward_weights are "
                                    "reward.weights (reward.name's first)"),
    ("optim.nesterov=true", "unknown config key 'optim'; verl's optim keys are trainer.lr, trainer.weight_decay, "
                            "trainer.warmup_iters, trainer.lr_schedule and trainer.min_lr_ratio"),
    ("trainer.lrr=1e-5", "unknown config key 'trainer.lrr'; did you mean trainer.lr?"),
    ("engine.kv.fromat=kv4", "unknown config key 'engine.kv.fromat'; did you mean engine.kv.format?"),
    # a section's key with `_` for its dot
    ("engine.kv_format=kv4", "unknown config key 'engine.kv_format'; did you mean engine.kv.format?"),
    ("rollout_group_size=4", "unknown config key 'rollout_group_size'; did you mean rollout.group_size?"),
    # upper case and `-` for `_`: "no kv4rl counterpart known" for TRAINER.LR, `trainer` for trainer-lr
    ("TRAINER.LR=1e-5", "unknown config key 'TRAINER'; did you mean trainer?"),
    ("trainer.LR=1e-5", "unknown config key 'trainer.LR'; did you mean trainer.lr?"),
    ("trainer-lr=1e-5", "unknown config key 'trainer-lr'; did you mean trainer.lr?"),
    ("engine.kv_cache_dtype=fp8", "unknown config key 'engine.kv_cache_dtype'; vLLM's and SGLang's kv_cache_dtype "
                                  "(fp8, fp8_e4m3) is engine.kv.format (bf16, fp8, int4, kv4, nvfp4, mxfp4)"),
])
def test_an_unknown_key_suggests_the_key_meant(override, suggested):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(suggested + " (known here: ")


def test_verls_reward_function_keys_point_to_a_plug_in_with_verl_score():
    for override in ("custom_reward_function.path=my.py", "custom_reward_function={path: my.py, name: f}"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert str(info.value).startswith("unknown config key 'custom_reward_function.path'; verl's "
                                          "custom_reward_function is a plug-in module (algo.plugins) that registers "
                                          "VerlScore(compute_score) as a reward")
    with pytest.raises(ConfigError, match="verl's reward_manager has no counterpart"):
        load_config(None, ["reward_model.reward_manager=naive"])


def test_an_unknown_key_with_nothing_close_suggests_nothing():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.foo=1"])
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("overrides, says", [
    (["rollout.top_p=0.95"], "PPO's ratio (algo.old_logprob=behavior) starts below 1"),
    (["rollout.top_k=5", "algo.loss=future_kl"], "the behaviour log-ratio starts below 1"),
    (["rollout.min_p=0.1"], "rollout.min_p=0.1 truncate what the engine samples"),
    ([], None),
])
def test_a_truncating_rollout_is_warned_about_its_ratio(caplog, overrides, says):
    """The engine reports log-probs of the truncated distribution, the learner of the whole one: with top_p 0.8
    a helper measured mismatch_absmax 0.21 at iteration 0 (ratio 0.81, at the clip edge) without a word."""
    import logging

    with caplog.at_level(logging.WARNING):
        load_config(overrides=overrides)
    lines = [m for m in caplog.messages if "truncate what the engine samples" in m]
    assert (says in lines[0]) if says else not lines


def test_an_override_that_yaml_would_cut_at_a_comment_is_refused():
    """`data.prompt_template=### Question: {problem}` became null (the default template), and `... #1` lost
    its tail, silently: the run trained on other prompts than the ones typed."""
    for override, value in (("data.prompt_template=### Question: {problem} ### Answer:", "None"),
                            ("data.prompt_template=Question {problem}  #1", "'Question {problem}'")):
        with pytest.raises(ConfigError, match=f"YAML reads .* as a comment, so the value would be {re.escape(value)}; "
                                              "quote the value"):
            load_config(overrides=[override])
    kept = load_config(overrides=["data.prompt_template='### Question: {problem} #1'"])
    assert kept.data.prompt_template == "### Question: {problem} #1"
    assert load_config(overrides=["data.prompt_template=C# {problem}"]).data.prompt_template == "C# {problem}"



def test_token_sum_norms_length_is_checked_and_said_to_be_unused_elsewhere(caplog, tmp_path):
    """algo.loss_norm_tokens is read by token_sum_norm only; a run's learner gets rollout.max_new_tokens as the
    length unless it is set, and a Learner built without either is refused by name."""
    with pytest.raises(ConfigError, match=r"algo.loss_norm_tokens must be >= 1"):
        load_config(overrides=["algo.loss_agg=token_sum_norm", "algo.loss_norm_tokens=0"])
    with caplog.at_level(logging.WARNING):
        load_config(overrides=["algo.loss_agg=token_sum_norm", "algo.loss_norm_tokens=512"])
    assert not [m for m in caplog.messages if "loss_norm_tokens" in m]
    with caplog.at_level(logging.WARNING):
        load_config(overrides=["algo.loss_norm_tokens=512"])
    assert [m for m in caplog.messages if "loss_norm_tokens" in m] == [
        "algo.loss_norm_tokens=512 is read by algo.loss_agg=token_sum_norm only; algo.loss_agg=token_mean ignores it"]

    import torch

    from kv4rl.run_setup import build_learner
    from kv4rl.trainer.learner import Learner
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path)
    cfg = load_config(overrides=["algo.loss_agg=token_sum_norm", "rollout.max_new_tokens=24", "device=cpu"])
    assert build_learner(cfg, tmp_path, tmp_path, torch.device("cpu")).norm_tokens == 24
    cfg = load_config(overrides=["algo.loss_agg=token_sum_norm", "algo.loss_norm_tokens=40", "device=cpu"])
    assert build_learner(cfg, tmp_path, tmp_path, torch.device("cpu")).norm_tokens == 40
    with pytest.raises(ValueError, match="token_sum_norm divides by a constant length: set algo.loss_norm_tokens"):
        Learner(tmp_path, None, algo=cfg.algo.__class__(loss_agg="token_sum_norm"), lr=1e-3, weight_decay=0.0,
                betas=(0.9, 0.999), grad_clip=1.0, micro_batch_size=2, updates_per_batch=1, temperature=1.0,
                device=torch.device("cpu"))


def _migration_table_keys() -> list[str]:
    """The verl and TRL key names in the first column of README's "Coming from" tables (values such as `grpo` in
    `loss_type: dapo` / `grpo` left out)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = []
    for title in ("## Coming from verl", "## Coming from TRL", "## Coming from slime, OpenRLHF or prime-rl",
                  "## Coming from AReaL"):
        start = readme.index(title)
        for line in readme[start:readme.index("\n## ", start + 5)].splitlines():
            if line.startswith("| `"):
                cells = re.findall(r"`([^`]+)`", line.split("|")[1])
                names += [c.split(":")[0] for c in cells if c not in ("grpo", "batch", "none", "sequence")]
    return names


@pytest.mark.parametrize("name", _migration_table_keys())
def test_every_name_in_the_migration_tables_is_pointed_to_its_kv4rl_key(name):
    """README says a pasted verl or TRL name gets the kv4rl key it means: a dozen of its own names got only the
    list of known keys, and whole verl paths (actor_rollout_ref.actor.clip_ratio_high) never got a pointer."""
    try:
        load_config(None, [f"{name}=1"])
    except ConfigError as exc:
        said = str(exc)
        assert re.match(r"unknown config key '[^']+'; ", said) or "must be" in said or "expected" in said, said


@pytest.mark.parametrize(("override", "said"), [
    ("actor_rollout_ref.rollout.val_kwargs.n=1", "unknown config key 'actor_rollout_ref.rollout.val_kwargs.n'; "
                                                 "verl's val_kwargs.n is eval.k"),
    ("actor_rollout_ref.rollout.n=1", "unknown config key 'actor_rollout_ref.rollout.n'; verl's rollout.n is "
                                      "rollout.group_size (its val_kwargs.n, samples per evaluated problem, is eval.k)"),
    # a critic's key that also names a policy key: the critic's lr followed the actor's in verl's PPO scripts, and
    # "did you mean trainer.lr?" trained the policy at the critic's rate
    ("critic.optim.lr=1e-5", "unknown config key 'critic.optim.lr'; a critic (verl's or AReaL's, the value model of "
                             "GAE) has no counterpart: kv4rl's estimators are critic-free (advantage.estimator)"),
    ("reward_model.model.path=/rm", "unknown config key 'reward_model.model.path'; verl's reward_model (a learned "
                                    "reward model) has no counterpart: rewards are rule-based (reward.name, or a "
                                    "plug-in such as VerlScore)"),
    ("actor_rollout_ref.actor.optim.clip_grad=1.0", "unknown config key 'actor_rollout_ref.actor.optim.clip_grad'; "
                                                    "verl's optim.clip_grad and slime's clip_grad are trainer.grad_clip"),
    # slime's flags with dashes, OpenRLHF's dotted flags of 2026, prime-rl's sections
    ("eps-clip=0.2", "unknown config key 'eps-clip'; slime's and OpenRLHF's eps_clip is algo.eps_low (and "
                     "algo.eps_high, which it also sets) (known here: " + ", ".join(
                         ["name", "out_dir", "seed", "device", "model", "data", "reward", "engine", "rollout",
                          "staleness", "algo", "advantage", "trainer", "checkpoint", "eval", "logging",
                          "telemetry"]) + ")"),
    ("train.batch_size=128", "unknown config key 'train.batch_size'; OpenRLHF's train.batch_size (samples per "
                             "optimizer step) is trainer.updates_per_batch = rollout.batch_size x "
                             "n_samples_per_prompt / train.batch_size, a count of steps"),
    # a name inside a kv4rl section is looked up with its path first: OpenRLHF's eval.n_samples_per_prompt is eval.k,
    # not the rollout's n_samples_per_prompt (rollout.group_size)
    ("eval.n_samples_per_prompt=4", "unknown config key 'eval.n_samples_per_prompt'; OpenRLHF's "
                                    "eval.n_samples_per_prompt is eval.k (known here: every, k, temperature, "
                                    "before_training)"),
    # AReaL's: reward_norm.group_size is the normalisation's group, not rollout.group_size
    ("actor.reward_norm.group_size=8", "unknown config key 'actor.reward_norm.group_size'; AReaL's reward_norm "
                                       "(mean_level and std_level group) is advantage.estimator=grpo (std_level null: "
                                       "advantage.normalize_std=false; its eps 1e-5, 1e-6 here); no reward_norm at all "
                                       "is advantage.estimator=raw (the reward itself)"),
    # a one-letter typo of the section's own key that is also another framework's name: both said
    ("trainer.beta=[0.9,0.95]", "unknown config key 'trainer.beta'; did you mean trainer.betas? (or: TRL's beta (the "
                                "reference-KL coefficient) is algo.kl_ref_coef; algo.beta is future_kl's future-KL "
                                "cost) (known here: iterations, lr, warmup_iters, lr_schedule, min_lr_ratio, "
                                "weight_decay, betas, grad_clip, micro_batch_size, updates_per_batch, epochs_per_batch, "
                                "grad_checkpointing, fsdp, offload, offload_optimizer, max_tokens_per_micro_batch, "
                                "attention, fuse_elementwise, compile_layers, fused_logprobs, ref_kl_every, "
                                "mask_truncated, mask_zero_advantage)"),
    ("orchestrator.max_off_policy_steps=2", "unknown config key 'orchestrator.max_off_policy_steps'; prime-rl's "
                                            "max_off_policy_steps is staleness.max_versions (with rollout.mode="
                                            "partial; prime-rl drops older rollouts, kv4rl samples them again)"),
    # none of a pasted path's keys has a counterpart: each is named, not only its section
    ("actor_rollout_ref.model.use_remove_padding=true", "unknown config key actor_rollout_ref.model.use_remove_padding: "
                                                        "no kv4rl counterpart known (README's 'Coming from ...' sections "
                                                        "list the keys that have one)"),
    # DAPO's overlong shaping sits in verl's reward_model section, whose other keys have no counterpart
    ("reward_model.overlong_buffer.len=512", "unknown config key 'reward_model.overlong_buffer.len'; verl's "
                                             "overlong_buffer.len is reward.overlong_buffer"),
    ("actor_rollout_ref.rollout.temperature=0.7", "unknown config key 'actor_rollout_ref.rollout.temperature'; did you "
                                                  "mean rollout.temperature or eval.temperature?"),
    ("engine.foo.block_size=16", "unknown config key 'engine.foo.block_size'; did you mean engine.kv.block_size?"),
    # a foreign section is read leaf by leaf: its own hint where no leaf has one
    ("optim.lr=1e-6", "unknown config key 'optim.lr'; did you mean trainer.lr?"),
    ("trainer.optim.max_norm=1.0", "unknown config key 'trainer.optim.max_norm'; OpenRLHF's and prime-rl's max_norm is "
                                   "trainer.grad_clip"),
    ("monitors.wandb.name=x", "unknown config key 'monitors.wandb.name'; the W&B run name is logging.wandb_name (with "
                              "logging.wandb=true)"),
    ("actor_rollout_ref.rollout.mode=async", "unknown config key 'actor_rollout_ref.rollout.mode'; verl's rollout.mode "
                                             "(sync: its engine's LLM API, async: AsyncLLM) has no counterpart; kv4rl's "
                                             "rollout.mode is another setting (partial: unfinished responses carried "
                                             "across updates), and its default sync matches verl's"),
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096", "unknown config key '+reward_model.reward_kwargs."
                                                                 "overlong_buffer_cfg.len'; verl's overlong_buffer_cfg."
                                                                 "len is reward.overlong_buffer"),
    ("algorithm.filter_groups.max_num_gen_batches=5", "unknown config key 'algorithm.filter_groups.max_num_gen_batches'"
                                                      "; verl's filter_groups.max_num_gen_batches is "
                                                      "rollout.filter_max_batches"),
])
def test_a_whole_pasted_verl_path_is_pointed_to_its_kv4rl_key(override, said):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert str(exc.value) == said


def test_every_config_key_is_in_the_readme_configuration_reference():
    """A key is listed by its dotted name, or by its last name in a row that names another key of its section
    (`trainer.lr`, `weight_decay`, `betas`). New keys of this session were nearly left out of the table."""
    def flat(mapping: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in mapping.items():
            out += flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
        return out

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("## Configuration reference")
    rows = [line for line in readme[start:readme.index("\n## ", start + 5)].splitlines() if line.startswith("| `")]
    missing = []
    for key in flat(to_dict(load_config(None, []))):
        section, _, last = key.rpartition(".")
        if not any(f"`{key}`" in row or (section and f"`{section}." in row.split("|")[1] and f"`{last}`" in row.split("|")[1])
                   for row in rows):
            missing.append(key)
    assert not missing, missing


def test_another_frameworks_value_names_the_kv4rl_value_that_works():
    """verl's `algo.kl_ref_type=low_var_kl` or `algo.loss_agg=token-mean` is refused with the kv4rl value, and that
    value (the hint's first word) loads."""
    from kv4rl.config_foreign import OTHER_VALUES

    assert OTHER_VALUES["algo.kl_ref_type"]["mse"].startswith("k2")
    for key, values in OTHER_VALUES.items():
        for foreign, hint in values.items():
            with pytest.raises(ConfigError, match=re.escape(f"; use {key}={hint}")):
                load_config(None, [f"{key}={foreign}"])
            kv4rl_value = hint.split()[0]
            extra = ["algo.old_logprob=recompute"] if key == "algo.behavior_is" else []
            section, name = key.split(".")
            assert getattr(getattr(load_config(None, [f"{key}={kv4rl_value}", *extra]), section), name) == kv4rl_value
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["algo.loss_agg=sum"])
    assert "; use" not in str(bad.value)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline", "grpo_passk"])
def test_grpos_std_keys_under_another_estimator_are_each_said_to_change_nothing(caplog, estimator):
    """std_scope is GRPO's alone; normalize_std GRPO's and grpo_passk's (which divides its lead by the group std)."""
    with caplog.at_level(logging.WARNING):
        load_config(None, [f"advantage.estimator={estimator}", "advantage.std_scope=batch",
                           "advantage.normalize_std=false"])
    said = [m for m in caplog.messages if "changes nothing" in m]
    assert said[0].startswith("advantage.std_scope=batch is read by advantage.estimator=grpo only")
    if estimator == "grpo_passk":
        assert len(said) == 1
    else:
        assert len(said) == 2
        assert said[1].startswith("advantage.normalize_std=false is read by advantage.estimator=grpo and grpo_passk "
                                  "only")
    assert all(f"advantage.estimator={estimator} divides by" in m for m in said)


def test_every_problem_of_a_config_is_said_at_once(tmp_path):
    """A pasted verl config heard of one key per run (about 40 reruns for a real script): every unknown key and
    bad value, in every section, is now one line of one error; a pasted section names each key another framework
    has, and the keys without a counterpart in one line."""
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "trainer.lr=abc",
                           "algo.loss_agg=token-mean", "rollout.group_size=2"])
    problems = bad.value.problems
    assert len(problems) == 4 and str(bad.value) == "\n".join(problems)
    assert problems[0].startswith("unknown config key 'algorithm.adv_estimator'; verl's adv_estimator is")
    assert problems[1].startswith("unknown config key 'data.train_batch_size'; verl's train_batch_size")
    assert problems[2] == "trainer.lr: expected float, got 'abc'"
    assert problems[3].startswith("algo.loss_agg: 'token-mean' is not one of")
    pasted = tmp_path / "verl.yaml"
    pasted.write_text("algorithm:\n  adv_estimator: grpo\n  gamma: 1.0\n  lam: 1.0\n"
                      "actor_rollout_ref:\n  actor:\n    clip_ratio_high: 0.28\n")
    with pytest.raises(ConfigError) as bad:
        load_config(pasted)
    assert bad.value.problems == [
        "unknown config key 'algorithm.adv_estimator'; verl's adv_estimator is advantage.estimator (grpo, rloo, "
        "reinforce_plus_plus_baseline, reinforce_plus_plus, opo, grpo_passk, gpg, remax or optimal_token_baseline)",
        "unknown config keys algorithm.gamma, algorithm.lam: no kv4rl counterpart known (README's 'Coming from ...' "
        "sections list the keys that have one)",
        "unknown config key 'actor_rollout_ref.actor.clip_ratio_high'; verl's clip_ratio_high is algo.eps_high"]
    with pytest.raises(ConfigError) as one:  # a single problem reads as before
        load_config(None, ["trainer.lr=abc"])
    assert one.value.problems == ["trainer.lr: expected float, got 'abc'"]


def test_the_cli_prints_one_error_line_per_problem(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kv4rl.cli import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "trainer.lr=abc", "rollout.group_size=x", "lr=1"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 3 and not (tmp_path / "runs").exists()


def test_print_config_says_what_train_would_refuse_without_reading_it(tmp_path, monkeypatch):
    """--print-config reads no model or data, so a Hub id as model.path passed it and train refused it: the
    missing paths and a tensor-parallel engine without torchrun's processes are now warned about (exit 0)."""
    from typer.testing import CliRunner

    from kv4rl.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    res = CliRunner().invoke(app, ["train", "model.path=Qwen/Qwen3-8B", "data.train=train.jsonl",
                                   "data.eval=gone.jsonl", "engine.tensor_parallel=2", "--print-config"])
    assert res.exit_code == 0, res.output
    warned = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: model.path={tmp_path / 'Qwen' / 'Qwen3-8B'} does not exist; train would refuse it",
                      f"warning: data.eval={tmp_path / 'gone.jsonl'} does not exist; train would refuse it",
                      "warning: engine.tensor_parallel=2 needs 2 processes per engine: start with `torchrun "
                      "--nproc-per-node 2 -m kv4rl.cli train ...`"]
    assert not (tmp_path / "runs").exists()
    clean = CliRunner().invoke(app, ["train", "data.train=train.jsonl", "--print-config"])
    assert clean.exit_code == 0 and "warning:" not in clean.output


@pytest.mark.parametrize(("override", "meant"), [
    # keys of real prime-rl, AReaL, OpenRLHF, slime, verl and TRL configs that had no pointer or a wrong one
    ("model.name=Qwen/Qwen3-4B", "model.path"), ("trainer.model.name=x", "model.path"),
    ("inference.vllm.model=x", "model.path"), ("sglang.model_path=x", "model.path"), ("pretrain=x", "model.path"),
    ("hf_checkpoint=x", "model.path"), ("monitors.wandb.project=p", "logging.wandb_project"),
    ("monitors.wandb.name=n", "logging.wandb_name"), ("stats_logger.wandb.mode=disabled", "logging.wandb"),
    ("inference.vllm.tensor_parallel_size=2", "engine.tensor_parallel"),
    ("vllm_tensor_parallel_size=2", "engine.tensor_parallel"), ("rollout_num_gpus_per_engine=2", "engine.tensor_parallel"),
    ("inference.vllm.max_num_seqs=64", "rollout.max_slots"), ("sglang.max_running_requests=64", "rollout.max_slots"),
    ("orchestrator.seq_len=4096", "trainer.max_tokens_per_micro_batch"),
    ("train.dynamic_batch_enable=true", "trainer.max_tokens_per_micro_batch"),
    ("trainer.model.ac.freq=1", "trainer.grad_checkpointing"), ("recompute_granularity=full", "trainer.grad_checkpointing"),
    ("actor.gradient_checkpointing_enable=true", "trainer.grad_checkpointing"),
    ("orchestrator.eval.num_examples=100", "data.eval_size"), ("orchestrator.eval.group_size=8", "eval.k"),
    ("sglang.context_length=4096", "engine.max_model_len"), ("data.max_len=4096", "engine.max_model_len"),
    ("vllm_max_model_length=4096", "engine.max_model_len"),
    ("sglang.mem_fraction_static=0.8", "engine.gpu_memory_fraction"),
    ("vllm_gpu_memory_utilization=0.3", "engine.gpu_memory_fraction"),
    ("train.colocate_all=true", "rollout.placement"), ("ckpt.path=/c", "out_dir"), ("apply_chat_template=true", "data.chat_template"),
    ("vllm.enable_sleep=true", "engine.sleep_between_rollouts"), ("vllm_enable_sleep_mode=true", "engine.sleep_between_rollouts"),
    ("attention_backend=flash", "trainer.attention"), ("adam_beta2=0.99", "trainer.betas"), ("use_wandb=true", "logging.wandb"),
    ("rm_type=deepscaler", "reward.name"), ("shuffle_dataset=true", "data.shuffle"), ("max_grad_norm=1.0", "trainer.grad_clip"),
    ("save_total_limit=2", "checkpoint.keep_last"), ("report_to=wandb", "logging.wandb"),
    ("trainer.scheduler.type=cosine", "trainer.lr_schedule"), ("recover.mode=auto", "--resume"),
    ("reward_model.reward_kwargs.max_resp_len=8192", "rollout.max_new_tokens"),
    ("actor_rollout_ref.rollout.enable_chunked_prefill=true", "engine.chunked_prefill"),
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.overlong_buffer"),
    ("loss.adv_tau=2", "algo.ipo_kl_coef"),  # prime-rl's ipo loss's users were sent to dppo's coefficient only
    # TRL GRPOConfig fields that listed the known keys only (trl HEAD's grpo_config.py read field by field)
    ("trust_remote_code=true", "model_type qwen3, qwen2, llama and mistral"),
    ("model_init_kwargs.dtype=bfloat16", "model.dtype"), ("model_init_kwargs=x", "learner trains in BF16"),
    ("router_aux_loss_coef=0.001", "mixture-of-experts"),
    ("disable_dropout=true", "no dropout"), ("cast_lm_head_to_fp32=true", "log-softmax over its logits in float32"),
    ("remove_unused_columns=false", "meta"), ("pad_to_multiple_of=8", "trainer.max_tokens_per_micro_batch"),
    ("chat_template_kwargs.enable_thinking=false", "data.chat_template=true"),
    ("vllm_structured_outputs_regex=x", "structured"),
])
def test_everyday_keys_of_other_frameworks_configs_name_the_kv4rl_key(override, meant):
    """Two reviews pasted every key of real example configs: these had no pointer, or `did you mean reward.name?`
    for prime-rl's monitors.wandb.name, `model.path` for OpenRLHF's ckpt.path. Each names its kv4rl key now."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    said = str(info.value)
    assert said.startswith("unknown config key") and meant in said.split(";", 1)[1], said
    assert "reward.name" not in said or meant == "reward.name"
