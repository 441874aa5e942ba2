"""Every `kv4rl …` command in README.md's bash blocks runs, made small, on the CPU.

Each command runs as written plus the small settings of its entry in `CASES`, appended at the end:
an option given twice keeps its last value (click) and `key=value` overrides apply in order, so the
appended ones win over the README's own. `replace` rewrites a word the small run cannot keep (a
checkpoint that the shortened run names differently). Commands run in README order in one scratch
folder (with a copy of `recipes/`), so one that reads a run folder finds what an earlier one made.

A README command without an entry fails `test_every_readme_command_has_a_case`, and so does an
entry whose command left the README: the table and the README stay in step.
"""

from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import CliRunner

from kv4rl.cli import app

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

TINY_TRAIN = "trainer.iterations=2 rollout.quota_groups=2 rollout.group_size=2 rollout.max_slots=4 --no-progress"
TINY_EVAL = "--n 4 --k 2"
# KV4 needs a context of at least n_sink + n_recent positions (16 below, 6 for bench generate)
TINY_FIDELITY = "--n 2 --max-new-tokens 12"
TINY_ROLLOUT = "--batches 1 --quota-groups 2 --group-size 2 --max-slots 4 --median-len 4 --max-len 8"
TINY_GENERATE = ("--shape qwen3-tiny --batch-sizes 2 --prompt-len 4 --new-tokens 4 --device cpu "
                 "engine.kv.group_size=32 engine.kv.n_sink=2 engine.kv.n_recent=4")
GPU = "times CUDA kernels (the command refuses to run without a CUDA device)"
REAL_WEIGHTS = "needs real weights in /models (the engine and loader are tested on random checkpoints)"


@dataclass(frozen=True)
class Case:
    append: str = ""
    replace: dict[str, str] = field(default_factory=dict)
    skip: str | None = None


CASES: dict[str, Case] = {
    # Set up and go, and `kv4rl train`
    "kv4rl train": Case(TINY_TRAIN),
    "kv4rl train --config recipes/baseline_clean.yaml trainer.lr=1e-5 rollout.group_size=8": Case(TINY_TRAIN),
    "kv4rl train --resume runs/tiny-arith": Case("--no-progress"),
    "kv4rl train reward.extra=[boxed_format] reward.weights=[1.0,0.2]": Case(TINY_TRAIN + " name=two-rewards"),
    "kv4rl train algo.loss_agg=token_sum_norm advantage.normalize_std=false": Case(TINY_TRAIN + " name=dr-grpo"),
    "kv4rl train algo.eps_high=0.28 trainer.mask_truncated=true reward.overlong_buffer=4 rollout.filter_groups=true":
        Case(TINY_TRAIN + " name=dapo"),
    "kv4rl train algo.ratio_level=sequence algo.eps_low=3e-4 algo.eps_high=4e-4 algo.loss_agg=seq_mean":
        Case(TINY_TRAIN + " name=gspo"),
    "kv4rl train advantage.estimator=rloo algo.top_entropy_quantile=0.2 algo.entropy_coeff=0.001 "
    "eval.before_training=true": Case(TINY_TRAIN + " name=rloo-80-20"),
    "kv4rl train advantage.estimator=reinforce_plus_plus_baseline algo.surrogate=cispo algo.old_logprob=recompute "
    "algo.behavior_is=token_truncate algo.off_policy_mask=0.5": Case(TINY_TRAIN + " name=rpp-cispo-tis"),
    "kv4rl train advantage.estimator=reinforce_plus_plus advantage.kl_reward_coef=0.001 rollout.min_p=0.05 "
    "algo.kl_ref_coef=0.01 algo.kl_ref_unbiased=true": Case(TINY_TRAIN + " name=rpp-kl-minp"),
    "kv4rl train --resume runs/tiny-arith trainer.iterations=200": Case("trainer.iterations=3 --no-progress"),
    # starts over: the run above moves aside, and the new one ends at iteration 3 like it did
    "kv4rl train --overwrite": Case(TINY_TRAIN + " trainer.iterations=3"),
    "kv4rl train --config recipes/baseline_clean.yaml --print-config": Case(),
    # `kv4rl eval` (the shortened run above ends at iteration 3, not 100)
    "kv4rl eval --model runs/tiny-arith/checkpoints/iter_000100": Case(
        TINY_EVAL, replace={"iter_000100": "iter_000003"}),
    "kv4rl eval --model /models/Qwen3-1.7B --data math500.jsonl --k 8 --json out.json": Case(skip=REAL_WEIGHTS),
    "kv4rl eval --model /models/Qwen3-1.7B --data math500.jsonl --k 8 engine.kv.format=kv4": Case(
        skip=REAL_WEIGHTS),
    # rollout modes and staleness
    "kv4rl train name=sync-run": Case(TINY_TRAIN),
    "kv4rl train name=partial-run rollout.mode=partial rollout.max_slots=64": Case(TINY_TRAIN),
    "kv4rl train name=lag4 staleness.lag=4": Case(TINY_TRAIN),
    "kv4rl train name=refresh8 staleness.refresh_every=8": Case(TINY_TRAIN),
    "kv4rl train name=recompute rollout.mode=partial staleness.max_versions=4 rollout.carry=recompute": Case(
        TINY_TRAIN),
    "kv4rl plot rollout-trace runs/sync-run runs/partial-run --out trace.png": Case(),
    "kv4rl bench rollout --formats bf16,kv4 --modes sync,partial --json rollout.json --png rollout.png": Case(
        TINY_ROLLOUT),
    "kv4rl bench rollout --shape qwen3-8b --kv-budget-gib 40 --quota-groups 16 --group-size 8 --max-slots 128 "
    "--prompt-len 256 --median-len 1024 --max-len 8192 --validate-only": Case(),
    # KV formats and fidelity
    "kv4rl bench fidelity --formats bf16,fp8,int4,kv4,nvfp4,mxfp4 --json fidelity.json": Case(
        TINY_FIDELITY),
    "kv4rl bench fidelity --formats kv4 --allocations 4+12,0+16,16+0,8+8 --group-size 32": Case(
        TINY_FIDELITY),
    "kv4rl bench fidelity --model \"$(python -c 'from kv4rl.models.smollm2 import smollm2_model_dir as d; "
    "print(d())')\" --data /data/gsm8k_test.jsonl --formats bf16,fp8,int4,kv4,nvfp4,mxfp4 --allocations "
    "4+28,0+32 --group-size 64 --n 8 --max-new-tokens 48 --json fidelity-smollm2.json": Case(
        skip="minutes of CPU on SmolLM2 and a data file; tests/test_smollm2.py runs a small fidelity "
             "measurement on the same model"),
    "kv4rl bench pool --shape qwen3-8b --memory-gib 40 --max-num-seqs 256 --context 8192 --json pool.json": Case(),
    "kv4rl bench generate --shape qwen3-1.7b --batch-sizes 64,256 --prompt-len 128 --new-tokens 256 "
    "--kv-format bf16,kv4 --json generate.json": Case(TINY_GENERATE),
    # GPU fast path
    "kv4rl bench decode-attn --shapes qwen3-8b --batches 64 --contexts 4096,8192,16384 "
    "--formats bf16,fp8,int4,kv4,kv4-triton --json attn.json": Case(skip=GPU),
    "kv4rl bench decode-forward --shapes qwen3-8b --workloads early,mid,late --json forward.json": Case(skip=GPU),
    "kv4rl bench decode-forward --shapes qwen3-8b --no-fused-ops": Case(skip=GPU),
    "kv4rl bench decode-forward --shapes qwen3-8b --no-merge-projections": Case(skip=GPU),
    "kv4rl bench generate --shape qwen3-1.7b --batch-sizes 64,256 --kv-format bf16,kv4 --json generate.json": Case(
        TINY_GENERATE),
    # objectives and simulations
    "kv4rl sim clip-bias --rho 1.5 --eps 0.2 --sigma 1.0 --json clip.json --png clip.png": Case(
        "--samples 2000 --sweep-rho 0.5,1.5"),
    "kv4rl sim correction-variance --behavior stale:4 --horizons 1,2,4,full --json cv.json": Case(
        "--n-prompts 2 --samples-per-prompt 2 --max-new-tokens 4 --stale-batch-size 2"),
    "kv4rl train --config recipes/staleness16_future_kl.yaml": Case(TINY_TRAIN),
    # plots of runs: the seed globs and arms point at the runs made above
    "kv4rl plot curves \"runs/ppo-s*\" \"runs/grpo-s*\" --metric accuracy --ema 0.9 --out figs/acc.png "
    "--json figs/acc.json": Case(replace={"runs/ppo-s*": "runs/sync-run", "runs/grpo-s*": "runs/partial-run"}),
    "kv4rl plot curves --arm base=\"runs/a/*\" --arm kv4=\"runs/b/*\" --metric eval/mean@1 --out figs/eval.png":
        Case(replace={"runs/a/*": "runs/lag4", "runs/b/*": "runs/refresh8", "eval/mean@1": "accuracy"}),
    "kv4rl plot iteration-time runs/sync-s0 runs/partial-s0 --skip 1 --out figs/time.png": Case(
        replace={"runs/sync-s0": "runs/sync-run", "runs/partial-s0": "runs/partial-run"}),
    # one GPU for engine and learner, testbeds
    "kv4rl bench learner --shape qwen3-1.7b --workload lognormal --json learner.json": Case(
        "--shape qwen3-tiny --device cpu --steps 1 --num-seqs 3 --prompt-len 3 --median-len 6 --max-len 40 "
        "--max-tokens 64 --checkpointing off --reference off"),
    "kv4rl bench iteration --shape qwen3-1.7b --arms bf16+sync,kv4+partial,fp8w+kv4+partial --json it.json "
    "--png it.png": Case("--shape qwen3-tiny --device cpu --quota-groups 2 --group-size 2 --max-slots 3 "
                         "--prompt-len 4 --median-len 6 --max-len 24 --iterations 1"),
    "kv4rl build-model --task longmul --size gpu": Case(replace={"gpu": "test"}),
    "kv4rl train --config recipes/testbed_longmul_gpu.yaml --seeds 0,1,2,3": Case(
        skip="several training processes; tests/test_multi_seed.py runs two seeds of a tiny config"),
    # mismatch attribution
    "kv4rl train name=attributed staleness.lag=1 telemetry.attribution_every=10 telemetry.attribution_samples=8":
        Case(TINY_TRAIN + " telemetry.attribution_every=1 telemetry.attribution_samples=2"),
    "kv4rl plot mismatch runs/attributed -o mismatch.png": Case(),
}


def readme_commands(text: str) -> list[str]:
    """The `kv4rl …` commands of the ```bash blocks, in order, each once: continuation lines joined,
    comments dropped, `a && b` chains split, whitespace collapsed."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)
            for part in line.split("&&"):
                command = " ".join(part.split())
                if command.startswith("kv4rl ") or command == "kv4rl":
                    if command not in commands:
                        commands.append(command)
    return commands


def small_args(command: str, case: Case) -> list[str]:
    for old, new in case.replace.items():
        assert old in command, f"replacement {old!r} no longer occurs in {command!r}"
        command = command.replace(old, new)
    return shlex.split(command)[1:] + shlex.split(case.append)


def test_readme_extraction_joins_continuations_and_splits_chains():
    text = ("```bash\npip install x && kv4rl train   # note\nkv4rl bench pool --a 1 \\\n    --b 2\n```\n"
            "```text\nkv4rl not-bash\n```\n```bash\nkv4rl train\n```\n")
    assert readme_commands(text) == ["kv4rl train", "kv4rl bench pool --a 1 --b 2"]
    assert small_args("kv4rl eval --model r/iter_000100", Case("--n 4", {"iter_000100": "iter_000003"})) == [
        "eval", "--model", "r/iter_000003", "--n", "4"]


def test_every_readme_command_has_a_case():
    commands = readme_commands(README.read_text())
    missing = [c for c in commands if c not in CASES]
    stale = [c for c in CASES if c not in commands]
    assert not missing, "README commands without an entry in CASES (say how to run them small, or why not):\n" + \
        "\n".join(missing)
    assert not stale, "CASES entries whose command is no longer in README.md:\n" + "\n".join(stale)


def test_readme_commands_run(tmp_path, monkeypatch):
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    failures, ran = [], 0
    for command in readme_commands(README.read_text()):
        case = CASES[command]
        if case.skip:
            continue
        result = runner.invoke(app, small_args(command, case))
        ran += 1
        if result.exit_code != 0:
            failures.append(f"$ {command}  [+ {case.append}]\nexit {result.exit_code}\n{result.output[-1500:]}"
                            f"{result.exception!r}")
    assert ran >= 20
    assert not failures, "\n\n".join(failures)
    assert (tmp_path / "runs/tiny-arith/checkpoints/iter_000003").is_dir()
    assert (tmp_path / "trace.png").stat().st_size > 0
