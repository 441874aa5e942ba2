"""Command line: `kv4rl train`, `eval`, `bench`, `sim`, `plot`.

`kv4rl train` with no arguments trains the embedded tiny model on the embedded arithmetic task.
Any config key can be overridden as `section.key=value` after the options.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from pathlib import Path

import typer

from kv4rl.cli_bench import bench_app
from kv4rl.cli_common import (
    setup_logging,
    os_error_text,
    TRACEBACK_ENV,
    wants_traceback,
    error_line,
    check_at_least,
    check_device,
    check_output_path,
    console,
    fail,
    option_list,
    say,
    warn,
    write_json,
    wrote,
)
from kv4rl.cli_eval import eval_cmd
from kv4rl.cli_outputs import check_spares_models_and_runs
from kv4rl.cli_plot import plot_app
from kv4rl.cli_sim import sim_app
from kv4rl.config_loader import ConfigError
from kv4rl.graceful_stop import catch_early, release_early
from kv4rl.telemetry.tables import ResultTable, metric_table, print_table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kv4rl: RL post-training with cheap rollouts.")


def _print_version(value: bool) -> None:
    if value:
        import torch  # noqa: F401  (loaded, so the versions name its CUDA release)

        from kv4rl.versions import software_versions

        print(" ".join(f"{name} {version}" for name, version in software_versions().items()))
        raise typer.Exit()


@app.callback()
def _quiet_libraries(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print kv4rl's version and the torch / triton / transformers it runs with"),
) -> None:
    """Keep the terminal for kv4rl's own progress: no per-file bars or notices from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _print_table(title: str, data: dict) -> None:
    print_table(console, metric_table(title, data))


@app.command()
def train(
    overrides: list[str] | None = typer.Argument(None, help="config overrides, e.g. trainer.lr=1e-5 (every key: README.md, 'Configuration reference')"),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config file"),
    resume: Path | None = typer.Option(None, "--resume", help="run folder to continue (runs/<name>)"),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="start over in a folder that holds a run (the old run is moved aside)"),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="show the progress bar, the engine's start-up line and the per-iteration "
                                       "lines (--no-progress: only the final table)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="also print the library's info lines"),
    seeds: str | None = typer.Option(
        None, "--seeds", help="comma-separated seeds: one run per seed into <out_dir>/<name>-s<seed>, in parallel "
                              "processes (with --resume runs/<name>: continue each runs/<name>-s<seed>)"),
    parallel: int | None = typer.Option(
        None, "--parallel", help="with --seeds: runs at once (default: all on CUDA, 1 on the CPU)"),
    print_config: bool = typer.Option(
        False, "--print-config", help="check the config's keys, types and combinations, print it as the run "
                                      "would save it (config.yaml) and stop: no model or data is read, nothing is written"),
) -> None:
    """Train a policy with RL (defaults: the embedded tiny model on the embedded arithmetic task).

    A run folder holds one run: training into one that holds a run stops before any work unless
    --overwrite. SIGTERM/SIGINT end the run after the current iteration with a checkpoint (exit 0).
    """
    # before the training code's imports (~4 s of torch and transformers): a SIGTERM or Ctrl-C from here on
    # stops the run (or a sweep before its seeds start), exit 0, instead of exit 143 or a KeyboardInterrupt; the
    # handlers it replaced are put back when the command returns (a program or test session that calls it keeps
    # its own Ctrl-C)
    catch_early()
    try:
        _train_command(config, overrides, resume, overwrite, verbose, progress, print_config, seeds, parallel)
    finally:
        release_early()


def _unread_inputs(cfg) -> list[str]:
    """--print-config reads no model or data; these cheap checks say what `train` would then refuse: a model or
    data path that is not there, and a tensor-parallel engine without the processes torchrun starts."""
    from kv4rl import distributed

    lines = [f"{key}={path} does not exist; train would refuse it"
             for key, given in (("model.path", cfg.model.path), ("data.train", cfg.data.train),
                                ("data.eval", cfg.data.eval))
             for path in (given if isinstance(given, list) else [given]) if path and not Path(path).exists()]
    tp = cfg.engine.tensor_parallel
    if tp > 1 and distributed.launched_ranks() % tp:
        lines.append(f"engine.tensor_parallel={tp} needs {tp} processes per engine: start with "
                     f"`torchrun --nproc-per-node {tp} -m kv4rl.cli train ...`")
    return lines


def _train_command(config: Path | None, overrides: list[str] | None, resume: Path | None, overwrite: bool,
                   verbose: bool, progress: bool, print_config: bool, seeds: str | None = None,
                   parallel: int | None = None) -> None:
    """`kv4rl train` once its signals are held: one run (or, with --seeds / --parallel, the seeds' runs)."""
    from kv4rl.config import load_config
    from kv4rl.loop import train as run_train
    from kv4rl.run_folder import config_for_resume

    from kv4rl import distributed

    setup_logging(verbose)
    if print_config and (seeds is not None or parallel is not None):
        fail("--print-config prints one run's config; give it without --seeds / --parallel")
    if seeds is not None or parallel is not None:
        if distributed.launched_ranks() > 1:
            fail("--seeds starts its own processes; run it without torchrun")
        _train_seeds(seeds, parallel, config, overrides or [], resume, overwrite, verbose)
        return
    ranks = cfg = None  # set once the config is read and the job is joined
    repeated = False  # this rank's error line was printed by another rank of the job already
    try:
        if resume is not None:
            if overwrite or config is not None:
                fail("--resume continues the run in its folder with its config.yaml; "
                     "--overwrite and --config do not apply")
            cfg = config_for_resume(resume, overrides or [])
        else:
            cfg = load_config(config, overrides or [])
        if print_config:
            import yaml

            from kv4rl.config import to_dict

            typer.echo(yaml.safe_dump(to_dict(cfg), sort_keys=False), nl=False)
            for line in _unread_inputs(cfg) if distributed.prints_setup_errors() else []:  # once under torchrun:
                warn(line)  # what train would refuse once it reads them, said without reading
            return
        ranks = distributed.init_from_torchrun(cfg.device)  # torchrun: one engine + learner shard per rank
        try:
            summary = run_train(cfg, resume=resume is not None, show_progress=progress and ranks.main,
                                overwrite=overwrite)
        except Exception as exc:
            if isinstance(exc, ValueError) and ranks.world > 1:  # asked before the job's store goes
                repeated = not distributed.first_to_report(str(exc))
            peer = distributed.stopped_peer(exc)  # None: this rank's own error (the others are told of it)
            if wants_traceback(verbose) or (peer is None and not distributed.lost_peer(exc)):
                raise
            if peer is not None:
                error_line(f"rank {peer} stopped (see its error); this rank stops too")  # its line says why
            else:  # its collective's ~300 lines of traceback named neither the rank nor the cause
                from kv4rl.trainer.checkpoint import resume_hint

                error_line("another rank of this job went down without a word (killed? the out-of-memory killer?); "
                           f"this rank stops too{resume_hint(cfg.run_dir, ranks.world)}")
            raise typer.Exit(1) from None
        finally:
            distributed.shutdown()
    except (ConfigError, ValueError) as exc:
        if getattr(exc, "show_traceback", False) and wants_traceback(verbose):  # a reward's own failure, asked for
            raise
        if (ranks is None and not distributed.prints_setup_errors()) or repeated:
            raise typer.Exit(2) from None  # the same error on every rank: one line says it
        fail(str(exc))
    except OSError as exc:  # a full disk, a folder without write permission: what is saved stays
        if wants_traceback(verbose):
            raise
        from kv4rl.trainer.checkpoint import resume_hint

        hint = "" if cfg is None else resume_hint(cfg.run_dir, None if ranks is None else ranks.world)
        error_line(os_error_text(exc) + hint)
        raise typer.Exit(1) from None
    if not ranks.main:
        return
    note = summary.pop("nothing_trained", None)
    _print_table(f"run {summary['run_dir']}", summary)
    if note is not None:
        warn(note)
    if "stopped_by" in summary and (Path(summary["run_dir"]) / "checkpoints").is_dir():
        # stopped before its first iteration, a resume wrote nothing: config.yaml lacks this resume's settings
        again = shlex.join(overrides) if resume is not None and overrides and "before the first" in \
            summary["stopped_by"] else ""
        say(f"stopped by {summary['stopped_by']}; continue with: "
            f"{distributed.resume_command(summary['run_dir'], ranks.world)}{' ' + again if again else ''}")


def _train_seeds(seeds_text: str | None, parallel: int | None, config: Path | None, overrides: list[str],
                 resume: Path | None, overwrite: bool, verbose: bool) -> None:
    """`train --seeds`: check every seed's config and folder, then run them (`kv4rl.multi_seed`)."""
    from kv4rl import multi_seed

    try:
        if seeds_text is None:
            raise ValueError("--parallel applies to --seeds runs; give --seeds too")
        seeds = option_list(seeds_text, "--seeds", int, minimum=0)
        check_at_least(1, ("--parallel", parallel))
        if resume is not None and (overwrite or config is not None):
            raise ValueError("--resume continues each seed's run in its folder with its config.yaml; "
                             "--overwrite and --config do not apply")
        runs = multi_seed.plan_runs(seeds, config, overrides, resume, overwrite,
                                    ["--no-progress"] + (["--verbose"] if verbose else []))
        at_once = min(parallel or multi_seed.default_parallel(runs), len(runs))
        multi_seed.share_device(runs, at_once)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    console.print(f"{len(runs)} seeds, {at_once} at a time", highlight=False)
    received = multi_seed.launch(runs, at_once, announce=say)
    table = ResultTable("seeds", ["seed", "run folder", "status", "iterations", "last accuracy", "seconds", "log"])
    for row in multi_seed.summary_rows(runs):
        table.add_row(*row)
    print_table(console, table)
    if any(r.stopped_by and not r.finished_at_signal for r in runs):
        say(f"stopped; {multi_seed.continue_hint(runs)}")
    failed = multi_seed.failed(runs)
    if failed:
        error_line(f"seeds {', '.join(map(str, failed))} failed; see their logs")
        # a seed killed after its checkpoints resumes like a stopped one, once the cause is mended
        say(f"then: {multi_seed.continue_hint([r for r in runs if r.seed in failed])}")
        raise typer.Exit(1)
    if len(received) > 1:  # a second signal ended the running seeds at once: as a single run, exit 128 + it
        raise typer.Exit(128 + received[1])


@app.command("build-model")
def build_model_cmd(
    task: str = typer.Option("longmul", "--task", help="arith (the tiny model's task) or longmul (worked long "
                                                       "multiplication, responses of hundreds of tokens)"),
    size: str | None = typer.Option(None, "--size", help="tiny (arith only: the default demo model), test (CPU, "
                                    "seconds) or gpu (longmul only: ~25M params, head_dim 128, minutes); default: gpu "
                                    "for longmul, tiny for arith"),
    device: str = typer.Option("auto", "--device", help="where to build (the folder is the same either way)"),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="default: $KV4RL_CACHE or ~/.cache/kv4rl"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the build record here"),
) -> None:
    """Build (or reload from the cache) a testbed model: a task's supervised warm-up stopped where RL has
    room to learn. Train on it with `kv4rl train model.testbed=<task>-<size>` (or model.path=<folder>)."""
    from kv4rl.models.testbed import TESTBEDS, check_testbed, read_metadata, testbed_folder, testbed_model_dir
    from kv4rl.models.tiny import default_cache_dir
    from kv4rl.paths import file_in_path

    if size is None:  # `--task arith` alone asked for arith-gpu, which does not exist
        size = "tiny" if task == "arith" else "gpu"
    name = f"{task}-{size}"
    try:
        known_tasks = sorted({t.split("-")[0] for t in TESTBEDS})
        if task not in known_tasks:
            raise ValueError(f"--task: unknown task '{task}' (known: {', '.join(known_tasks)})")
        check_testbed(name, "--task/--size")
        check_device(device)
        cache = cache_dir if cache_dir is not None else default_cache_dir()
        blocking = file_in_path(cache)
        if blocking is not None:
            where = f"--cache-dir {cache}" if cache_dir is not None else f"the kv4rl cache {cache} ($KV4RL_CACHE)"
            raise ValueError(f"{where}: cannot be created, {blocking} is a file")
    except ValueError as exc:
        fail(str(exc))
    check_output_path(json_out)
    check_spares_models_and_runs({"--json": json_out}, {"the testbed's model folder": testbed_folder(name, cache)})
    from kv4rl.engine.placement import resolve_device

    if size == "gpu" and resolve_device(device).type == "cpu":
        warn(f"{name} is sized for a GPU: its warm-up of a ~25M-parameter model is very slow on the CPU (--size test "
             f"builds in seconds)")
    cached = {(p.name, p.stat().st_ino) for p in cache.iterdir()} if cache.is_dir() else set()
    try:
        path = testbed_model_dir(name, cache_dir, progress=True, device=device)
    except ValueError as exc:
        fail(str(exc))
    record = read_metadata(path) or {}
    if name == "arith-tiny":  # the embedded model keeps its own record
        from kv4rl.models.tiny import METADATA_FILE

        record = json.loads((path / METADATA_FILE).read_text())
    # a folder not in the cache before (a new build, or a stale one replaced) was built now, however fast
    shown = {"testbed": name, "path": str(path), "built now": (path.name, path.stat().st_ino) not in cached,
             **{k: record[k] for k in ("parameters", "build_seconds", "warmup_steps_taken", "sampled_accuracy",
                                        "greedy_accuracy", "sampled_response_len", "solution_len_mean")
                if record.get(k) is not None}}
    from kv4rl.models.fingerprint import model_fingerprint

    shown["weights_sha256"] = model_fingerprint(path)  # a build of an older version: computed now
    _print_table("testbed model", shown)
    write_json({**record, **shown}, json_out)
    wrote(json_out)


app.command("eval")(eval_cmd)

app.add_typer(plot_app, name="plot")
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")


def main() -> None:
    """The `kv4rl` command: the app, with a config error that escaped a command as one line (exit 2), a
    failing file operation as one line naming the file (exit 1), and one line after Ctrl-C, which typer turns
    into a silent exit 130. A refused option (`--rho nan`, an unknown `--bogus`) is one `error:` line naming
    the command's --help (exit 2), like every other refused input, not typer's boxed usage block."""
    # click's error class, whether typer uses click or its own copy of it (typer >= 0.2x vendors click)
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    from kv4rl.graceful_stop import cleanup_on_sigterm

    # a scheduler's SIGTERM (a time limit) ended eval and the benches at once, with nothing said of the partial
    # --json they keep; `train` has its own handling (a checkpoint, then exit 0)
    terminable = cleanup_on_sigterm() if sys.argv[1:2] != ["train"] else contextlib.nullcontext()
    try:
        with terminable:
            code = app(standalone_mode=False)  # click's own errors come here, not to typer's printer
        if isinstance(code, int) and code:  # typer.Exit(n) in a command, 130 after Ctrl-C
            raise SystemExit(code)
    except click_error as exc:
        if not exc.format_message():  # `kv4rl sim` alone: click printed the group's help, nothing to add
            sys.exit(exc.exit_code)
        where = f" ({exc.ctx.command_path} --help shows its usage)" if getattr(exc, "ctx", None) is not None else ""
        error_line(f"{exc.format_message().rstrip('.')}{where}")
        sys.exit(exc.exit_code)
    except typer.Abort:  # end of input at a prompt
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except ConfigError as exc:
        error_line(str(exc))  # a line per problem: a pasted config hears of all its keys at once
        sys.exit(2)
    except OSError as exc:  # the machine, not the input: a full disk, a folder without write permission
        if wants_traceback(bool({"-v", "--verbose"} & set(sys.argv[1:]))):
            raise
        error_line(f"{os_error_text(exc)} ({TRACEBACK_ENV}=1 shows where)")
        sys.exit(1)
    except SystemExit as exc:
        if exc.code == 130:  # Ctrl-C: typer exits with 130 and says nothing
            say_interrupted()
        elif exc.code == 143:  # SIGTERM (`cleanup_on_sigterm`)
            say_interrupted("SIGTERM")
        raise


def say_interrupted(by: str = "Ctrl-C") -> None:
    """One line on stderr after Ctrl-C or SIGTERM: that the command stopped, and which --json files hold only
    part."""
    from kv4rl.cli_common import PARTIAL_JSON

    kept = "; ".join(f"{path} holds the rows finished before it (\"complete\": false)" for path in sorted(PARTIAL_JSON))
    print(f"{'interrupted' if by == 'Ctrl-C' else 'terminated'} ({by}){': ' + kept if kept else ''}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    main()
