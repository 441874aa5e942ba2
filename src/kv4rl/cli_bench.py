"""`kv4rl bench …`: measurements of the rollout engine, printed as a table and written as JSON.

- `fidelity` (SPEC §6): shared-prefix conditional KL of each KV-cache format against a reference
  cache, top-1 agreement and bytes per token. The numbers come from `kv4rl.bench.fidelity`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from typer import Option

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks of the rollout engine.")
console = Console()

ALL_FORMATS = "bf16,fp8,int4,kv4,nvfp4,mxfp4"


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _fidelity_table(res: dict) -> Table:
    shape = res["model_shape"]
    table = Table(title=(
        f"KV fidelity vs {res['reference']} cache — {res['num_prompts']} prompts, "
        f"{res['response_tokens_mean']:.0f} response tokens each (mean), {shape['layers']} layers x "
        f"{shape['kv_heads']} KV heads x head_dim {shape['head_dim']}, group {res['kv']['group_size']}"
    ))
    buckets = sorted({b for r in res["results"] for b in r["kl_by_position"]},
                     key=lambda b: int(b.split("-")[0].rstrip("+")))
    for name in ("format", "allocation", "KL mean", *[f"KL @{b}" for b in buckets], "top-1 agree",
                 f"bytes/token @{res['context_for_bytes']}", "vs bf16"):
        table.add_column(name, justify="left" if name in ("format", "allocation") else "right")
    for r in res["results"]:
        table.add_row(
            r["format"], r["allocation"] or "-", f"{r['kl_mean']:.3e}",
            *[f"{r['kl_by_position'][b]:.3e}" if b in r["kl_by_position"] else "-" for b in buckets],
            f"{r['top1_agree']:.4f}", f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_bf16']:.1%}",
        )
    return table


def _prompts(model_dir: Path, data: Path | None, n: int, template: str | None, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kv4rl.data.prompts import PromptFormatter
    from kv4rl.data.source import ProblemSource

    source = ProblemSource(None, str(data) if data else None, seed)
    problems = source.eval_problems(n)
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(model_dir), template or source.default_template)
    return [formatter.ids(p) for p in problems]


@bench_app.command()
def fidelity(
    model: Annotated[Path | None, Option(
        "--model", help="HF checkpoint folder (default: embedded tiny model)")] = None,
    random_init: Annotated[str | None, Option(
        "--random-init", help="use a random-init model of this shape instead (qwen3-0.6b)")] = None,
    random_layers: Annotated[int | None, Option(
        "--random-layers", help="layers of the --random-init model (default: the shape's)")] = None,
    data: Annotated[Path | None, Option(
        "--data", help="JSONL with problem rows (default: embedded task)")] = None,
    formats: Annotated[str, Option("--formats", help="comma-separated KV formats to measure")] = ALL_FORMATS,
    allocations: Annotated[str | None, Option(
        "--allocations", help="kv4 SINK+RECENT allocations, e.g. 16+128,0+144 (default: 16+128, or the same "
                              "1:8 split over a quarter of a context too short for it)")] = None,
    reference: Annotated[str, Option(
        "--reference", help="KV format the responses are sampled with")] = "bf16",
    n: Annotated[int, Option("--n", help="number of prompts")] = 16,
    max_new_tokens: Annotated[int | None, Option(
        "--max-new-tokens", help="response length (default: 256, capped by the model's context)")] = None,
    temperature: Annotated[float, Option("--temperature")] = 1.0,
    ignore_eos: Annotated[bool, Option(
        "--ignore-eos/--stop-at-eos", help="sample every response to its full length, or stop at EOS",
    )] = True,
    group_size: Annotated[int | None, Option(
        "--group-size", help="int4/kv4 group (default: 128, or head_dim if smaller)")] = None,
    rotate: Annotated[str, Option("--rotate", help="auto (k for kv4, none otherwise), none, k, kv")] = "auto",
    block_size: Annotated[int, Option("--block-size")] = 16,
    context: Annotated[int, Option(
        "--context", help="context length at which bytes/token are stated")] = 8192,
    batch_size: Annotated[int, Option("--batch-size", help="sequences teacher-forced together")] = 16,
    template: Annotated[str | None, Option("--template", help="prompt template with {problem}")] = None,
    device: Annotated[str, Option("--device")] = "auto",
    dtype: Annotated[str, Option("--dtype", help="model dtype (auto: bf16 on CUDA, fp32 on CPU)")] = "auto",
    seed: Annotated[int, Option("--seed")] = 0,
    json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    verbose: Annotated[bool, Option("--verbose", "-v")] = False,
) -> None:
    """Shared-prefix conditional KL of each KV format against the reference cache (SPEC §6)."""
    from kv4rl.bench.fidelity import (
        build_variants,
        default_allocation,
        kl_order,
        parse_allocations,
        run_fidelity,
    )
    from kv4rl.engine.config import KVConfig
    from kv4rl.models.hf_weights import check_model_folder

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if model is not None and random_init is not None:
            raise ValueError("pass either --model or --random-init, not both")
        if random_init is not None:
            from kv4rl.bench.random_model import random_model_dir

            with console.status(f"building random-init {random_init}"):
                model = random_model_dir(random_init, random_layers, seed)
        elif model is None:
            from kv4rl.models.tiny import tiny_model_dir

            model = tiny_model_dir()
        args = check_model_folder(model)
        prompts = _prompts(model, data, n, template, seed)
        room = args.max_position_embeddings - max(len(p) for p in prompts)
        max_new_tokens = max_new_tokens or min(256, room)
        kv = KVConfig(block_size=block_size, group_size=group_size or min(128, args.head_dim), rotate=rotate)
        kv.validate()
        context_len = max(len(p) for p in prompts) + max_new_tokens
        budgets = parse_allocations(allocations) if allocations else [default_allocation(context_len)]
        variants = build_variants([f.strip() for f in formats.split(",") if f.strip()], budgets)
        res = run_fidelity(model, prompts, variants, reference=reference, kv=kv,
                           max_new_tokens=max_new_tokens,
                           temperature=temperature, ignore_eos=ignore_eos, seed=seed, context_len=context,
                           device=device, dtype=dtype, batch_size=batch_size,
                           progress=lambda message: console.print(f"[dim]{message}[/]"))
    except ValueError as exc:
        _fail(str(exc))
    console.print(_fidelity_table(res))
    console.print(f"KL order: {kl_order(res['results'])}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2) + "\n")
