"""`kv4rl eval`: mean@k and pass@k of a model on a dataset, on one process or under torchrun.

Under `torchrun --nproc-per-node N` every rank builds its own engine (cuda:LOCAL_RANK with NCCL, or
the CPU with gloo), engines of `engine.tensor_parallel` consecutive ranks as in `kv4rl train`, and
samples its share of the problems (`kv4rl.eval.data_parallel`); rank 0 alone summarises, prints and
writes. Options are checked on every rank before any process group or model exists.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import typer

from kv4rl.cli_common import (
    check_at_least,
    check_device,
    check_temperature,
    check_not_an_input,
    check_output_path,
    console,
    engine_config,
    fail,
    finite_float,
    wants_traceback,
    warn,
    write_together,
    wrote,
)
from kv4rl.cli_outputs import check_spares_models_and_runs
from kv4rl.telemetry.progress import StageProgress
from kv4rl.telemetry.tables import metric_table, print_table


# run-config keys a user may carry over from `train`, and the eval option that sets each
EVAL_OPTIONS = {"rollout.temperature": "--temperature", "eval.temperature": "--temperature",
                "rollout.max_new_tokens": "--max-new-tokens", "eval.k": "--k", "seed": "--seed",
                "model.path": "--model", "data.eval": "--data", "data.train": "--data", "reward.name": "--reward",
                "data.prompt_template": "--template", "data.chat_template": "--chat", "device": "--device",
                "data.eval_size": "--num-problems", "algo.plugins": "--plugins"}


def _check_eval_options(k: int, n: int, temperature: float, max_new_tokens: int | None, reward: str,
                        template: str | None, device: str, plugins: list[str] | None = None) -> None:
    """Refuse bad options before the model loads (ValueError naming the option); import the plug-ins first."""
    from kv4rl.algo.registry import import_plugins
    from kv4rl.data.prompts import check_template
    from kv4rl.distributed import launched_ranks
    from kv4rl.rewards import registered_rewards

    if plugins:  # a reward plug-in registers its name when imported, as train's algo.plugins does
        try:
            import_plugins([m.strip() for given in plugins for m in given.split(",") if m.strip()])
        except ValueError as exc:
            raise ValueError(str(exc).replace("algo.plugins:", "--plugins:", 1)) from None
    check_at_least(1, ("--k", k), ("--max-new-tokens", max_new_tokens))
    check_at_least(0, ("--n/--num-problems", n))
    check_temperature("--temperature", temperature)
    if reward != "auto" and reward not in registered_rewards():
        raise ValueError(f"--reward: unknown reward '{reward}' (known: auto, {', '.join(registered_rewards())})")
    if template is not None:
        check_template(template, "--template")
    check_device(device)
    if launched_ranks() > 1 and re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"--device {device}: under torchrun each rank takes its own GPU (cuda:LOCAL_RANK); "
                         "give --device cuda (or auto, or cpu)")


def _eval_context(formatter, problems, what: str, engine_len: int | None, model_len: int,
                  max_new_tokens: int, say_warning: bool = True) -> int:
    """The engine's `max_model_len`: every prompt must leave room for a response (else an error naming
    it); responses that would run past the context are cut there, with one warning line."""
    from kv4rl.data.prompts import longest_prompt, overrun_warning

    if engine_len is not None and engine_len > model_len:
        raise ValueError(f"engine.max_model_len={engine_len} exceeds the model's context of {model_len} positions")
    limit = engine_len or model_len
    limit_name = "engine.max_model_len" if engine_len else "the model's context"
    longest = longest_prompt(formatter, problems, limit, limit_name, what)
    warning = overrun_warning(longest, max_new_tokens, f"--max-new-tokens {max_new_tokens}", limit, limit_name)
    if warning and say_warning:
        warn(warning)
    need = longest + max_new_tokens
    return engine_len or min(need, model_len)


def _default_model(main: bool) -> Path:
    """The embedded tiny model's folder; under torchrun rank 0 builds a missing one while the others wait."""
    from kv4rl.distributed import barrier
    from kv4rl.models.tiny import tiny_model_dir

    if not main:
        barrier()
    path = tiny_model_dir()
    if main:
        barrier()
    return path


def _prompting_differences(model: Path, chat: bool, template: str | None, eval_template: str | None = None,
                           ) -> list[str]:
    """How a run's checkpoint is prompted here unlike its run prompted it (the run's config.yaml beside its
    checkpoints/ folder): an instruct model trained with its chat template answers badly without it, and
    nothing said that eval does not read the run's settings. `template`: eval's --template (None: not
    given); `eval_template`: the template eval prompts with (default: `template`)."""
    import yaml

    from kv4rl.data.source import default_prompt_template

    folder = Path(model).resolve().parent
    saved = folder.parent / "config.yaml"
    if folder.name != "checkpoints" or not saved.is_file():
        return []
    try:
        data = (yaml.safe_load(saved.read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    lines = []
    run_chat = bool(data.get("chat_template", False))
    if run_chat != chat:
        lines.append(f"its run prompted {'with' if run_chat else 'without'} the tokenizer's chat template "
                     f"(data.chat_template: {str(run_chat).lower()} in {saved}); pass "
                     f"{'--chat' if run_chat else '--no-chat'} to evaluate it as it was trained")
    eval_template = template if eval_template is None else eval_template
    run_template = data.get("prompt_template")
    if run_template and run_template != eval_template:
        lines.append(f"its run prompted with data.prompt_template {run_template!r} ({saved}); pass --template "
                     f"with it to evaluate it as it was trained")
    elif not run_template and eval_template is not None:  # the run's default, against what eval prompts with
        default = default_prompt_template(embedded=data.get("train") is None and data.get("eval") is None)
        if eval_template != default and template is not None:
            lines.append(f"its run prompted with the default template {default!r} (data.prompt_template: null in "
                         f"{saved}); --template {template!r} prompts it otherwise")
        elif eval_template != default:  # eval's own default differs (a run on the embedded task, a data file here)
            lines.append(f"its run prompted with the default template {default!r} (data.prompt_template: null in "
                         f"{saved}); eval prompts with its default here, {eval_template!r}: pass --template "
                         f"with the run's to evaluate it as it was trained")
    return lines


def _samples_text(problems, results) -> str:
    """One JSON line per problem, in problem order: its id, gold answer, and each sample's score, token
    count and text."""
    return "".join(json.dumps({"index": r.index, "id": problems[r.index].id, "answer": problems[r.index].answer,
                               "scores": list(r.scores), "response_lens": list(r.lengths),
                               "responses": list(r.texts)}) + "\n" for r in results)


def eval_cmd(
    engine_overrides: list[str] | None = typer.Argument(
        None, help="engine settings as in the run config, e.g. engine.kv.format=kv4 engine.kv.group_size=32"),
    model: Path | None = typer.Option(None, "--model", help="HF checkpoint folder (default: embedded tiny model)"),
    data: list[Path] | None = typer.Option(None, "--data", help="JSON Lines or Parquet with problem/answer rows, or "
                                            "verl's Parquet; repeat it for several files, read one after another "
                                            "(default: embedded task)"),
    k: int = typer.Option(8, "--k", help="samples per problem"),
    n: int = typer.Option(0, "--n", "--num-problems",
                          help="evaluate the first n problems (0: all; embedded task: 256); under torchrun give "
                               "--num-problems, since torchrun takes --n for an abbreviation of its own options"),
    temperature: float = typer.Option(1.0, "--temperature", parser=finite_float,
                                      help="sampling temperature; 0: greedy"),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens",
        help="response limit (default: 1024, embedded task: 16, a testbed: the limit its build measured with; "
             "capped by the context)"),
    reward: str = typer.Option(
        "auto", "--reward", help="reward function (auto: exact for the embedded task, math_verify for --data)"),
    reward_timeout: float = typer.Option(
        5.0, "--reward-timeout", parser=finite_float,
        help="seconds math_verify may take per answer before it scores 0 (train's reward.timeout_s; give the "
             "run's to score its checkpoints as its in-training eval did)"),
    plugins: list[str] | None = typer.Option(
        None, "--plugins", help="modules to import first, comma-separated or the option repeated (e.g. a reward "
                                "plug-in's, as train's algo.plugins; they must be on the Python path)"),
    template: str | None = typer.Option(
        None, "--template", help="prompt template with {problem} (default: the boxed-answer instruction for --data)"),
    chat: bool = typer.Option(False, "--chat/--no-chat", help="apply the tokenizer's chat template"),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N (under torchrun: cuda:LOCAL_RANK)"),
    seed: int = typer.Option(0, "--seed", help="sampling seed; without --data it also draws the embedded "
                                               "task's problems"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the results and settings here"),
    samples_out: Path | None = typer.Option(
        None, "--samples", help="also write one JSON line per problem: its samples' scores, lengths and texts"),
) -> None:
    """Report mean@k and pass@k of a model on a dataset (under torchrun: the problems shared out over
    the ranks' engines, one table and file from rank 0)."""
    from kv4rl import distributed
    from kv4rl.config_loader import ConfigError

    try:
        _check_eval_options(k, n, temperature, max_new_tokens, reward, template, device, plugins)
        if not reward_timeout > 0:
            raise ValueError(f"--reward-timeout must be > 0, got {reward_timeout:g}")
        engine_cfg = engine_config(engine_overrides, EVAL_OPTIONS)
        world = distributed.launched_ranks()
        if world % engine_cfg.tensor_parallel:
            raise ValueError(f"engine.tensor_parallel={engine_cfg.tensor_parallel} does not divide the {world} "
                             "ranks torchrun started" if world > 1 else
                             f"engine.tensor_parallel={engine_cfg.tensor_parallel} needs that many processes: "
                             f"start with `torchrun --nproc-per-node {engine_cfg.tensor_parallel} -m kv4rl.cli eval ...`")
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    check_output_path(json_out, create=False)  # folders made once the data and model have loaded
    check_output_path(samples_out, "--samples", create=False)
    files = list(data or [])
    for i, path in enumerate(files):  # one file twice would count its problems twice
        earlier = next((other for other in files[:i] if other.resolve() == path.resolve()), None)
        if earlier is not None:
            fail(f"--data {path} is given twice (also as --data {earlier}); its problems would count twice")
    check_not_an_input({"--json": json_out, "--samples": samples_out}, {f"--data {path}": path for path in files})
    check_spares_models_and_runs({"--json": json_out, "--samples": samples_out}, {"the model folder --model": model})
    data = None if not files else files[0] if len(files) == 1 else files  # a list: its rows one file after another
    ranks = distributed.init_from_torchrun(device)
    try:
        res, settings, results, problems = _run(engine_cfg, list(engine_overrides or []), ranks, model, data, k, n,
                                                temperature, max_new_tokens, reward, template, chat, device, seed,
                                                reward_timeout)
        distributed.barrier()  # every rank past its last collective before any rank takes the groups down
    except ValueError as exc:
        if getattr(exc, "show_traceback", False) and wants_traceback():  # a reward's own failure, asked for
            raise
        if ranks.world > 1 and not distributed.first_to_report(str(exc)):  # before the job's store goes
            raise typer.Exit(2) from None  # the same error on every rank (a model the engine cannot shard)
        fail(str(exc))
    finally:
        distributed.shutdown()
    if not ranks.main:
        return
    print_table(console, metric_table("evaluation", res))
    check_output_path(json_out)
    check_output_path(samples_out, "--samples")
    # both whole or neither: a failed write (a full disk) leaves the earlier pair as it was
    from kv4rl.versions import stamped

    write_together({json_out: json.dumps(stamped({**res, **settings}), indent=2) + "\n",
                    samples_out: _samples_text(problems, results) if samples_out is not None else None})
    wrote(json_out, samples_out)


LATEST_ATTEMPTS = 3  # loads of a run's newest checkpoint, each pruned by the run while it loaded


def _run(engine_cfg, overrides, ranks, model, data, k, n, temperature, max_new_tokens, reward, template, chat,
         device, seed, reward_timeout=5.0):
    """Load the model and data, sample this rank's share, gather: (metrics, settings, per-problem results,
    problems) on rank 0; the metrics and results are None on the other ranks. A model given as a run's
    `checkpoints/latest` that the run prunes while it loads (`checkpoint.keep_last`) is loaded again from
    the newest (one process), else refused by name: it failed as a missing model, missing weights or a bad
    Hugging Face repo id, depending on the moment."""
    from kv4rl.data.prompts import boxed_request_note
    from kv4rl.distributed import from_main
    from kv4rl.eval.data_parallel import evaluate_ranks
    from kv4rl.models.hf_weights import ModelFolderError, latest_checkpoint
    from kv4rl.models.testbed import read_metadata
    from kv4rl.rewards import get_reward

    if model is None and data is not None:  # read again once the model is there: a bad file is named before
        from kv4rl.data.datasets import load_problems  # a missing embedded model is built (~30 s)

        load_problems(data)
    given = model if model is not None else _default_model(ranks.main)
    for attempt in range(1, LATEST_ATTEMPTS + 1):
        # `checkpoints/latest`: the newest checkpoint it names, read by rank 0 for every rank (a run saving
        # meanwhile must not give the ranks different checkpoints)
        model = from_main(latest_checkpoint(given) or given)
        try:
            loaded = _load(engine_cfg, ranks, model, data, k, n, temperature, max_new_tokens, template, chat,
                           device, seed)
            break
        except Exception:
            if model == given or model.exists():
                raise
            if latest_checkpoint(given) == model:  # a run prunes only after `latest` names a newer checkpoint
                raise ModelFolderError(
                    f"{given} names {model.name}, which is not in {model.parent} (deleted or moved?); give a "
                    f"checkpoint folder there as --model") from None
            # a training run that writes it pruned this checkpoint (checkpoint.keep_last) while it loaded
            if ranks.world > 1 or attempt == LATEST_ATTEMPTS:
                raise ModelFolderError(
                    f"{model} was removed while it loaded: the run writing {given.parent.parent} keeps only its "
                    f"newest checkpoints (checkpoint.keep_last). Run again to evaluate the newest, or copy the "
                    f"checkpoint out of the run first") from None
            warn(f"{model.name} was removed by the run writing it (checkpoint.keep_last) while it loaded; "
                 f"loading the newest")
    engine, formatter, problems, source, task, max_new_tokens = loaded
    reward_name = source.default_reward if reward == "auto" else reward
    note = boxed_request_note(problems, formatter, reward_name, eval_cli=True) if data and ranks.main else None
    if note:
        warn(note)
    stages = StageProgress(console, "eval") if ranks.main else contextlib.nullcontext()
    # as train builds it: only math_verify takes the time limit (a plug-in's factory runs with its defaults)
    options = {"timeout_s": reward_timeout} if reward_name == "math_verify" else {}
    with get_reward(reward_name, **options) as reward_fn, stages:
        res, results = evaluate_ranks(engine, formatter, problems, reward_fn, ranks, k=k, temperature=temperature,
                                      max_new_tokens=max_new_tokens, seed=seed, progress=stages if ranks.main else None)
    if res is not None:
        # a testbed folder is evaluated on its own task: say which, not "embedded"
        named = _named(data) if data else (f"testbed task {(read_metadata(model) or {}).get('testbed', type(task).__name__)}"
                                        if task is not None else "embedded")
        res = {"model": str(model), "data": named, **res}
    settings = {"reward": reward_name, **({"reward_timeout_s": reward_timeout} if options else {}),
                "template": formatter.template, "chat_template": chat,
                "temperature": temperature, "max_new_tokens": max_new_tokens,
                "max_model_len": engine.max_model_len, "seed": seed, "engine": overrides,
                "engines": ranks.world // engine.tp.size}
    return res, settings, results, problems


def _named(data: Path | list[Path]) -> str:
    """--data as the table and --json name it: the file, or the files comma-separated."""
    return ", ".join(str(p) for p in data) if isinstance(data, list) else str(data)


def _load(engine_cfg, ranks, model, data, k, n, temperature, max_new_tokens, template, chat, device, seed):
    """The model folder's checks, tokenizer and engine, and the problems: everything that reads `model`."""

    from kv4rl.data.longmul import LongMulTask
    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource
    from kv4rl.engine.llm import Engine
    from kv4rl.models.hf_weights import check_model_folder, load_tokenizer
    from kv4rl.models.testbed import read_metadata, task_of

    model_args = check_model_folder(model)
    model_len = model_args.max_position_embeddings
    task = task_of(model) if data is None else None  # a testbed folder is evaluated on its own task
    source = ProblemSource(None, ([str(p) for p in data] if isinstance(data, list) else str(data)) if data else None,
                           seed, task=task)
    problems = source.eval_problems(n or (256 if data is None else 10**9))
    if n and data is not None and len(problems) < n and ranks.main:
        warn(f"--n {n}: {_named(data)} holds {len(problems)} problems; evaluating all {len(problems)}")
    tokenizer = load_tokenizer(model, model_args.vocab_size if ranks.main else None)
    formatter = PromptFormatter(tokenizer, template or source.default_template, chat)
    if ranks.main:
        for line in _prompting_differences(model, chat, template, formatter.template):
            warn(line)
        for line in source.verl_prompt_notes(template, chat, eval_cli=True,
                                             chat_template=bool(getattr(tokenizer, "chat_template", None))):
            warn(line)
        if temperature == 0 and k > 1:
            warn(f"--temperature 0 samples greedily: a problem's {k} samples are the same, so pass@j equals pass@1 "
                 f"for every j (sample at a temperature above 0, or pass --k 1)")
    if max_new_tokens is None and task is not None:  # the limit the testbed's build measured with (fits it)
        max_new_tokens = (read_metadata(model) or {}).get("eval_max_new_tokens")
    max_new_tokens = max_new_tokens or (1024 if not source.embedded else 2048 if isinstance(task, LongMulTask)
                                        else 16)
    engine_cfg.max_model_len = _eval_context(formatter, problems, f"--data {data}" if data else "embedded task",
                                             engine_cfg.max_model_len, model_len, max_new_tokens, ranks.main)
    # no more slots than requests: on the CPU the pool holds every slot at max_model_len (4.6 GiB for 32
    # requests of a 135M model at 256 slots). No tokenizer: the eval decodes each response once, itself
    engine = Engine(model, engine_cfg, device=device, seed=seed, max_num_seqs=max(1, min(256, len(problems) * k)))
    return engine, formatter, problems, source, task, max_new_tokens
