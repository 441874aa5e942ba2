"""How close the decode step's weight GEMMs run to the byte roofline (a diagnostic for bench/kernel_notes.md).

A decode step multiplies M = batch rows by every weight matrix once, so at M <= 256 each product should
take about the time to read its weight (bytes / copy bandwidth). This times `F.linear` (what the engine
calls, cuBLAS) for the merged projections of one decoder layer of a Qwen3 shape and its LM head, at the
batch sizes the engine runs, each as CUDA-graph replays (no launch gaps), and prints the achieved
bandwidth of the weight bytes and its share of the copy bandwidth the byte roofline uses
(`kv4rl.bench.roofline`):

    python tools/gemm_decode_shapes.py --shape qwen3-8b --rows 64,128,256

`--fp8` also times, on the same weights quantized to e4m3, the two FP8 products the engine has, both
with the activations quantized per token by the Triton kernel: `torch._scaled_mm` (also with
`use_fast_accum=True`, cuBLAS's FP8 running sum, as the Triton kernel sums) and the Triton e4m3
GEMM (`kv4rl.kernels.fp8_weight_gemm`, `engine.fp8_gemm=triton`) with `pick_config`'s tiles. `--sweep`
tries a grid of tile settings of the Triton kernel and prints the best per product for e4m3
activations, for bf16 activations (weight-only) and on the BF16 weights (against cuBLAS).
`--blas cublas,cublaslt` times each BF16 product once per library `torch.backends.cuda.preferred_blas_library`
can pick (cuBLAS chooses split-K kernels plus a reduce at some decode shapes; cuBLASLt chooses by its own
heuristics), so a step's products can be compared library by library in one run.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kv4rl.bench.decode_attn import _time_graph
from kv4rl.bench.random_model import qwen3_args
from kv4rl.bench.roofline import copy_bandwidth
from kv4rl.engine.fp8_linear import FP8Linear
from kv4rl.kernels.fp8_quant import quantize_rows_fp8
from kv4rl.kernels.fp8_weight_gemm import GemmConfig, counter_slots, fp8_weight_matmul, pick_config


def sweep_configs(m: int, k: int):
    """The tile settings `--sweep` tries for `m` rows (the swapped kernel: `block_m` is the token tile)."""
    top = min(256, max(16, 1 << (m - 1).bit_length()))
    for bm in sorted({top} | {b for b in (64, 128) if b < top}):
        for bn in (64, 128):
            for bk, warps, stages in ((64, 4, 4), (128, 4, 3), (128, 4, 4), (128, 8, 4), (256, 4, 3)):
                for split in (1, 2, 4, 8):
                    if k % (split * bk) == 0 and k // split >= 2 * bk:
                        yield GemmConfig(bm, bn, bk, split, warps, stages)


def table_configs(m: int, k: int, tma: bool = False):
    """`--table`: e4m3 settings, each with the float32 add per K block and with one running FP8 sum; with
    `tma`, settings of the TMA-fed kernel (one running sum, deeper pipelines)."""
    for bm in sorted({min(128, max(16, 1 << (m - 1).bit_length())), 64} if m > 64 else {max(16, 1 << (m - 1).bit_length())}):
        for bn in (64, 128):
            stages_by_k = ((128, 4), (128, 6), (256, 3), (256, 4), (256, 5)) if tma else ((128, 3), (128, 4), (256, 3))
            for bk, stages in stages_by_k:
                for split in (1, 2, 4):
                    if k % (split * bk) == 0 and k // split >= 2 * bk:
                        for fast in (True,) if tma else (False, True):
                            yield GemmConfig(bm, bn, bk, split, 4, stages, fast, tma)


def time_table(x, w, tma: bool = False) -> dict:
    """us of every `table_configs` setting of the e4m3 product (activation quantization included), and of
    `pick_config`'s ("pick")."""
    lin = FP8Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.load_weight_(w)
    counters = torch.zeros(counter_slots(w.shape[0], x.shape[0]), dtype=torch.int32, device=w.device)
    xq, xs = quantize_rows_fp8(x)
    ref = fp8_weight_matmul(xq, lin.qweight, lin.weight_scale, None, counters, x_scale=xs).float()
    out = {}
    for cfg in [None, *table_configs(x.shape[0], w.shape[1], tma)]:
        def call(cfg=cfg):
            xq, xs = quantize_rows_fp8(x)
            return fp8_weight_matmul(xq, lin.qweight, lin.weight_scale, None, counters, cfg, x_scale=xs)
        name = "pick" if cfg is None else _short(cfg.__dict__) + (" fast" if cfg.fast_accum else "") + (" tma" if cfg.tma else "")
        try:
            err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                raise SystemExit(f"{name} off pick_config's product by {err:.3g} at {tuple(x.shape)} x {tuple(w.shape)}")
            out[name] = 1e3 * _time_graph(call, calls=20, reps=10)
        except SystemExit:
            raise
        except Exception as e:  # out of shared memory
            print(f"  skipped {cfg}: {type(e).__name__}")
    return out


def _operands(x: torch.Tensor, fp8_x: bool):
    """(activations, their per-row scale or None) for the weight-only (bf16) or e4m3 x e4m3 product."""
    if not fp8_x:
        return x, None
    codes, scale = quantize_rows_fp8(x)
    return codes, scale


def warm(shape: str, rows: list[int], part: int, parts: int, table: bool = False, tma: bool = False) -> None:
    """Compile (into Triton's disk cache) every `parts`-th sweep setting from `part`: run in parallel
    processes before a sweep, so the timed run only loads kernels."""
    # M, N and K are runtime arguments (all multiples of 16 here), so one kernel serves a setting everywhere
    first = {}
    for m in rows:
        for k, _ in layer_shapes(shape).values():
            for cfg in (table_configs(m, k, tma) if table else sweep_configs(m, k)):
                first.setdefault(cfg, (m, k))
    todo = [(m, k, cfg) for cfg, (m, k) in sorted(first.items(), key=repr)][part::parts]
    for m, k, cfg in todo:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        codes = torch.zeros(64 * cfg.block_n, k, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.ones(codes.shape[0], device="cuda")
        counters = torch.zeros(counter_slots(codes.shape[0], m), dtype=torch.int32, device="cuda")
        for fp8_x, w in ((True, codes),) if table else ((False, codes), (True, codes), (False, codes.bfloat16())):
            try:
                xx, xs = _operands(x, fp8_x)
                fp8_weight_matmul(xx, w, scale, None, counters, cfg, x_scale=xs)
            except Exception as e:  # out of shared memory for the larger tiles: the sweep skips them too
                print(f"  cannot compile {cfg} fp8_x={fp8_x} {w.dtype}: {type(e).__name__}")
    torch.cuda.synchronize()


def _best(x, codes, scale, counters, ref, fp8_x: bool) -> tuple[float, GemmConfig]:
    """The fastest sweep setting (us, with the activation quantization for `fp8_x`), checked against `ref`."""
    def call(cfg):
        xx, xs = _operands(x, fp8_x)
        return fp8_weight_matmul(xx, codes, scale, None, counters, cfg, x_scale=xs)

    best = None
    for cfg in sweep_configs(x.shape[0], codes.shape[1]):
        try:
            us = 1e3 * _time_graph(lambda cfg=cfg: call(cfg), calls=20, reps=10)
        except Exception as e:  # out of shared memory for the larger tiles
            print(f"  skipped {cfg}: {type(e).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    if fp8_x:  # the product of the dequantized activations
        xq, xs = quantize_rows_fp8(x)
        ref = F.linear(xq.float() * xs[:, None], codes.float() * scale[:, None])
    err = ((call(best[1]).float() - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-2:
        raise SystemExit(f"best setting {best[1]} (fp8_x={fp8_x}) off by {err:.3g}")
    return best


def time_fp8(x, w, sweep: bool) -> dict:
    """us of the scaled_mm path, the weight-only GEMM (pick_config) and, with `sweep`, the best setting of
    the weight-only GEMM and of the e4m3 x e4m3 one (activation quantization included)."""
    lin = FP8Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.load_weight_(w)
    lin.fused_quant, lin.use_scaled_mm = True, True
    counters = torch.zeros(counter_slots(w.shape[0], x.shape[0]), dtype=torch.int32, device=w.device)
    ref = F.linear(x.float(), lin.dequantized_weight(torch.float32))
    out = {"scaled_mm_us": 1e3 * _time_graph(lambda: lin._scaled_mm(x), calls=20)}
    scaled = lin._scaled_mm(x)

    def fast_scaled_mm():  # the same product with cuBLAS's fast accumulation (what the Triton kernel does)
        codes, xs = quantize_rows_fp8(x)
        return torch._scaled_mm(codes, lin.qweight.t(), scale_a=xs.view(-1, 1), scale_b=lin.weight_scale.view(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=True)

    # cuBLAS's running sum moved 8B down_proj (K = 12,288, 128 tokens) by 1.16% of the output's range once
    # (twenty-second session): recorded, and refused only well above what the Triton kernel is allowed
    out["scaled_mm_fast_err"] = ((fast_scaled_mm().float() - scaled.float()).abs().max() / scaled.float().abs().max()).item()
    if out["scaled_mm_fast_err"] > 5e-2:
        raise SystemExit(f"scaled_mm with fast accumulation off by {out['scaled_mm_fast_err']:.3g} at "
                         f"{tuple(x.shape)} x {tuple(w.shape)}")
    out["scaled_mm_fast_us"] = 1e3 * _time_graph(fast_scaled_mm, calls=20)
    lin.enable_decode_gemm()  # the engine's path with engine.fp8_gemm=triton: the same quantization, pick_config's tiles
    got = lin._scaled_mm(x)
    # the running FP8 sum (fast accumulation) at K = 12,288 reached 1.09% of the output's range once
    # (twenty-second session; cuBLAS's own fast accumulation 1.16%): recorded, refused well above that
    err = out["decode_gemm_err"] = ((got.float() - scaled.float()).abs().max() / scaled.float().abs().max()).item()
    if err > 5e-2:
        raise SystemExit(f"Triton e4m3 GEMM off scaled_mm by {err:.3g} of the output's range at {tuple(x.shape)} x {tuple(w.shape)}")
    out["decode_gemm_us"] = 1e3 * _time_graph(lambda: lin._scaled_mm(x), calls=20)
    out["decode_gemm_config"] = pick_config(x.shape[0], w.shape[0], w.shape[1],
                                            torch.cuda.get_device_properties(0).multi_processor_count).__dict__
    if sweep:
        for key, fp8_x in (("best", False), ("best_w8a8", True)):
            us, cfg = _best(x, lin.qweight, lin.weight_scale, counters, ref, fp8_x)
            out[f"{key}_us"], out[f"{key}_config"] = us, cfg.__dict__
        # the same kernel on the BF16 weights (scale 1): a skinny GEMM against cuBLAS at the BF16 bytes
        ones = torch.ones(w.shape[0], device=w.device)
        us, cfg = _best(x, w.contiguous(), ones, counters, F.linear(x.float(), w.float()), False)
        out["best_bf16w_us"], out["best_bf16w_config"] = us, cfg.__dict__
    return out


def _short(cfg: dict) -> str:
    return "m{block_m} n{block_n} k{block_k} s{split_k} w{num_warps} st{num_stages}".format(**cfg)


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of the engine's products at `shape`, merged q|k|v and gate|up."""
    a = qwen3_args(shape)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return {"qkv": (a.hidden_size, q + 2 * kv), "o": (q, a.hidden_size), "gate_up": (a.hidden_size, 2 * a.intermediate_size),
            "down": (a.intermediate_size, a.hidden_size), "lm_head": (a.hidden_size, a.vocab_size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--json", default=None)
    p.add_argument("--fp8", action="store_true", help="also time the FP8 products on the same weights")
    p.add_argument("--sweep", action="store_true", help="with --fp8: search the weight-only GEMM's tiles")
    p.add_argument("--blas", default=None, metavar="LIBS",
                   help="also time the BF16 products under each of these BLAS libraries (e.g. cublas,cublaslt)")
    p.add_argument("--table", action="store_true", help="time every e4m3 setting of a small grid (JSON only)")
    p.add_argument("--tma", action="store_true", help="with --table: the grid of the TMA-fed kernel")
    p.add_argument("--warm-only", default=None, metavar="I/N", help="compile the I-th of N parts of the sweep, time nothing")
    a = p.parse_args()
    if a.warm_only:
        part, parts = (int(v) for v in a.warm_only.split("/"))
        warm(a.shape, [int(x) for x in a.rows.split(",")], part, parts, a.table, a.tma)
        return
    bw = copy_bandwidth(torch.device("cuda"))
    if bw is None:
        raise SystemExit(f"no copy bandwidth measured for {torch.cuda.get_device_name()} (kv4rl.bench.roofline)")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (kv4rl.bench.roofline)")
    rows = []
    layers = qwen3_args(a.shape).num_layers
    libs = a.blas.split(",") if a.blas else []
    default_lib = torch.backends.cuda.preferred_blas_library()
    for m in [int(x) for x in a.rows.split(",")]:
        table_pick_ms = table_best_ms = 0.0
        step_ms = roof_ms = fp8_step_ms = scaled_step_ms = scaled_fast_step_ms = best_step_ms = w8a8_step_ms = bf16w_step_ms = 0.0
        lib_step_ms = dict.fromkeys(libs, 0.0)
        for name, (k, n) in layer_shapes(a.shape).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sec = _time_graph(lambda x=x, w=w: F.linear(x, w), calls=20) / 1e3
            wbytes = n * k * 2
            count = 1 if name == "lm_head" else layers
            step_ms += 1e3 * sec * count
            roof_ms += 1e3 * wbytes / bw * count
            row = {"rows": m, "gemm": name, "in": k, "out": n, "us": 1e6 * sec,
                   "weight_tb_s": wbytes / sec / 1e12, "of_copy": wbytes / sec / bw}
            line = (f"M={m:4d} {name:8s} {k:6d}x{n:6d}: {1e6 * sec:8.1f} us  {wbytes / sec / 1e12:5.2f} TB/s "
                    f"({100 * wbytes / sec / bw:4.0f}% of copy)")
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                us = 1e3 * _time_graph(lambda x=x, w=w: F.linear(x, w), calls=20)
                torch.backends.cuda.preferred_blas_library(default_lib)
                row[f"us_{lib}"] = us
                lib_step_ms[lib] += us / 1e3 * count
                line += f" | {lib} {us:7.1f} us ({1e6 * sec / us:4.2f}x)"
            if a.table and name != "lm_head":
                row["table_us"] = time_table(x, w, a.tma)
                best = min(row["table_us"], key=row["table_us"].get)
                line += f" | e4m3 pick_config {row['table_us']['pick']:7.1f} us, table best {row['table_us'][best]:7.1f} us {best}"
                table_pick_ms += row["table_us"]["pick"] / 1e3 * count
                table_best_ms += min(v for key, v in row["table_us"].items() if key != "pick") / 1e3 * count
            if a.fp8 and name != "lm_head":  # the engine keeps the LM head in bf16
                row.update(time_fp8(x, w, a.sweep))
                fp8_bytes = n * k
                line += (f" | fp8 scaled_mm {row['scaled_mm_us']:7.1f} us (fast accumulation {row['scaled_mm_fast_us']:7.1f}), Triton e4m3 {row['decode_gemm_us']:7.1f} us "
                         f"({fp8_bytes / row['decode_gemm_us'] / 1e6:4.2f} TB/s, {sec * 1e6 / row['decode_gemm_us']:4.2f}x bf16) "
                         f"{_short(row['decode_gemm_config'])}")
                if a.sweep:
                    line += (f", best {row['best_us']:7.1f} us ({sec * 1e6 / row['best_us']:4.2f}x bf16) "
                             f"{_short(row['best_config'])}, best e4m3 x e4m3 {row['best_w8a8_us']:7.1f} us "
                             f"({sec * 1e6 / row['best_w8a8_us']:4.2f}x) {_short(row['best_w8a8_config'])}"
                             f" | Triton on bf16 weights {row['best_bf16w_us']:7.1f} us ({sec * 1e6 / row['best_bf16w_us']:4.2f}x cuBLAS) "
                             f"{_short(row['best_bf16w_config'])}")
                    bf16w_step_ms += min(1e6 * sec, row["best_bf16w_us"]) / 1e3 * count
                    best_step_ms += row["best_us"] / 1e3 * count
                    w8a8_step_ms += row["best_w8a8_us"] / 1e3 * count
                fp8_ms = row["decode_gemm_us"] / 1e3 * count
                fp8_step_ms += fp8_ms
                scaled_step_ms += row["scaled_mm_us"] / 1e3 * count
                scaled_fast_step_ms += row["scaled_mm_fast_us"] / 1e3 * count
            elif a.fp8:
                fp8_step_ms += 1e3 * sec * count
                scaled_step_ms += 1e3 * sec * count
                scaled_fast_step_ms += 1e3 * sec * count
                best_step_ms += 1e3 * sec * count
                w8a8_step_ms += 1e3 * sec * count
                bf16w_step_ms += 1e3 * sec * count
            rows.append(row)
            print(line)
        print(f"M={m:4d} all products of a step: {step_ms:.2f} ms against {roof_ms:.2f} ms of weight bytes "
              f"({100 * roof_ms / step_ms:.0f}%)")
        if a.table:
            print(f"M={m:4d} e4m3 block products of a step: pick_config {table_pick_ms:.2f} ms, the table's best per "
                  f"product{' (TMA)' if a.tma else ''} {table_best_ms:.2f} ms ({table_pick_ms / table_best_ms:.2f}x)")
        for lib, ms in lib_step_ms.items():
            print(f"M={m:4d} all products under {lib}: {ms:.2f} ms ({step_ms / ms:.2f}x the default)")
        if a.fp8:
            print(f"M={m:4d} with FP8 block weights (LM head bf16): Triton e4m3 (pick_config) {fp8_step_ms:.2f} ms "
                  f"({step_ms / fp8_step_ms:.2f}x bf16), scaled_mm {scaled_step_ms:.2f} ms ({step_ms / scaled_step_ms:.2f}x), "
                  f"scaled_mm with fast accumulation {scaled_fast_step_ms:.2f} ms ({step_ms / scaled_fast_step_ms:.2f}x)")
            if a.sweep:
                print(f"M={m:4d} best settings: weight-only (bf16 activations) {best_step_ms:.2f} ms ({step_ms / best_step_ms:.2f}x bf16), "
                      f"e4m3 x e4m3 {w8a8_step_ms:.2f} ms ({step_ms / w8a8_step_ms:.2f}x); BF16 weights, the faster of "
                      f"cuBLAS and Triton per product: {bf16w_step_ms:.2f} ms ({step_ms / bf16w_step_ms:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "copy_tb_s": bw / 1e12, "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
