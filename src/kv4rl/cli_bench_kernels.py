"""`kv4rl bench decode-attn` and `kv4rl bench decode-forward`: the GPU decode kernels and one whole decode
step (optionally tensor-parallel under torchrun), timed on CUDA only."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer import Option

from kv4rl.bench.tables import decode_attn_table, decode_forward_table
from kv4rl.cli_common import check_at_least, check_output_path, console, fail, option_list, write_json, wrote
from kv4rl.telemetry.progress import StageProgress
from kv4rl.telemetry.tables import print_table


def _need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        fail("this benchmark times GPU kernels and needs a CUDA device")


def _decode_forward_tp(shape_list, work, fused_ops: bool, size: int, json_out, merge_projections: bool,
                       fp8_gemm: str, fp8_inputs: bool) -> None:
    """The tensor-parallel decode step on every rank; rank 0 prints, times one GPU and writes the JSON."""
    from kv4rl import distributed
    from kv4rl.bench.decode_forward import run_decode_forward_tp

    if distributed.launched_ranks() != size:
        fail(f"--tensor-parallel {size} runs under torchrun: torchrun --nproc-per-node {size} -m kv4rl.cli "
             f"bench decode-forward --tensor-parallel {size} ...")
    res = run_decode_forward_tp(shape_list, work, size, fused_ops, merge_projections, fp8_gemm, fp8_inputs)
    if res is not None:
        print_table(console, decode_forward_table(res, fused_ops))
        write_json(res, json_out)
        wrote(json_out)
    distributed.barrier()
    distributed.shutdown()


def register_kernel_benches(app: typer.Typer) -> None:
    """Add the two commands to `kv4rl bench`."""

    @app.command("decode-attn")
    def decode_attn(
        shapes: Annotated[str, Option("--shapes", help="head shapes: qwen3-1.7b, qwen3-4b, qwen3-8b")] = "qwen3-8b",
        batches: Annotated[str, Option("--batches", help="comma-separated batch sizes")] = "64",
        contexts: Annotated[str, Option("--contexts", help="comma-separated context lengths")] = "2048,4096,8192,16384",
        formats: Annotated[str, Option(
            "--formats", help="KV formats: bf16, fp8, int4, kv4; fp8-triton / int4-triton / kv4-triton run the "
                              "FP8 or INT4 body in the Triton kernel instead of the CUDA one; kv4-serial launches "
                              "KV4's INT8 item after the INT4 body instead of beside it")] = "bf16,fp8,int4,kv4",
        seed: Annotated[int, Option("--seed", help="random seed of the query, key and value tensors")] = 0,
        json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    ) -> None:
        """One layer's paged decode attention per KV format vs torch SDPA (cuDNN) on contiguous BF16."""
        from kv4rl.bench.decode_attn import FORMATS, HEAD_SHAPES, run_decode_attn

        try:
            shape_list = option_list(shapes, "--shapes", known=list(HEAD_SHAPES))
            fmt_list = option_list(formats, "--formats", known=FORMATS)
            batch_list = option_list(batches, "--batches", int, minimum=1)
            context_list = option_list(contexts, "--contexts", int, minimum=1)
        except ValueError as exc:
            fail(str(exc))
        check_output_path(json_out, create=False)
        _need_cuda()
        check_output_path(json_out)  # its missing folders, now that nothing refuses
        cases = len(shape_list) * len(batch_list) * len(context_list) * len(fmt_list)
        with StageProgress(console, "decode-attn") as stages:
            stages(f"timing {cases} kernel cases (each also against SDPA)", 0, cases)
            res = run_decode_attn(shape_list, batch_list, context_list, fmt_list, seed=seed, progress=lambda r: stages.advance(
                f"{r['shape']} {r['format']} B{r['batch']} L{r['context']}: {r['ms']:.4f} ms"))
        print_table(console, decode_attn_table(res))
        write_json(res, json_out)
        wrote(json_out)


    @app.command("decode-forward")
    def decode_forward(
        shapes: Annotated[str, Option("--shapes", help="model shapes: qwen3-4b, qwen3-8b, ...")] = "qwen3-8b",
        workloads: Annotated[str, Option(
            "--workloads", help="early (B256 x 1024), mid (B128 x 4096), late (B64 x 8192), short (B64 x 1024: "
                                "weights are most of the bytes)")] = "early,mid,late",
        fused_ops: Annotated[bool, Option(
            "--fused-ops/--no-fused-ops", help="fused norms/RoPE/SwiGLU kernels, as the engine runs on CUDA "
                                               "(engine.fused_ops=auto)")] = True,
        merge_projections: Annotated[bool, Option(
            "--merge-projections/--no-merge-projections", help="one GEMM for q|k|v and one for gate|up, as the "
                                                               "engine runs (engine.merge_projections=true)")] = True,
        tensor_parallel: Annotated[int, Option(
            "--tensor-parallel", help="shard the model over N GPUs (run under torchrun --nproc-per-node N); "
                                      "rank 0 also times one GPU for the ratio")] = 1,
        fp8_gemm: Annotated[str, Option(
            "--fp8-gemm", help="FP8 weights' product up to 128 tokens, as engine.fp8_gemm: auto (the Triton "
                               "e4m3 GEMM with fused ops), triton, scaled_mm")] = "auto",
        fp8_inputs: Annotated[bool, Option(
            "--fp8-inputs/--no-fp8-inputs", help="with fused ops, the norms and SwiGLU quantize the FP8 linears' "
                                                 "inputs (as the engine runs); off: each linear does")] = True,
        json_out: Annotated[Path | None, Option("--json", help="also write the results here")] = None,
    ) -> None:
        """One whole-model decode step (CUDA graph) for BF16/FP8 weights x BF16/KV4 cache (figure B-9)."""
        from kv4rl.bench.decode_forward import VARIANTS, WORKLOADS, fp8_gemm_problem, run_decode_forward
        from kv4rl.bench.random_model import QWEN3_SHAPES

        try:
            shape_list = option_list(shapes, "--shapes", known=list(QWEN3_SHAPES))
            work = option_list(workloads, "--workloads", known=list(WORKLOADS))
            check_at_least(1, ("--tensor-parallel", tensor_parallel))
            problem = fp8_gemm_problem(fp8_gemm, fused_ops, "--fp8-gemm", "--fused-ops")
            if problem:
                raise ValueError(problem)
        except ValueError as exc:
            fail(str(exc))
        check_output_path(json_out, create=False)
        _need_cuda()
        check_output_path(json_out)  # its missing folders, now that nothing refuses
        if tensor_parallel > 1:
            _decode_forward_tp(shape_list, work, fused_ops, tensor_parallel, json_out, merge_projections, fp8_gemm,
                               fp8_inputs)
            return
        cases = len(shape_list) * len(VARIANTS) * len(work)
        with StageProgress(console, "decode-forward") as stages:
            stages(f"timing {cases} decode steps", 0, cases)
            res = run_decode_forward(shape_list, work, fused_ops=fused_ops, merge_projections=merge_projections,
                                     fp8_gemm=fp8_gemm, fp8_inputs=fp8_inputs, progress=lambda r: stages.advance(
                f"{r['shape']} {r['workload']} w={r['weights']} kv={r['kv']}: "
                + (f"{r['ms']:.2f} ms" if r["ms"] is not None else "does not fit")))
        print_table(console, decode_forward_table(res, fused_ops))
        write_json(res, json_out)
        wrote(json_out)
