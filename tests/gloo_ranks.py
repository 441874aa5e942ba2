"""Run a function on N CPU processes joined by a gloo process group (tests of the distributed code)."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

# The ranks start from a forkserver that has imported these once per session, instead of each spawned
# rank importing them afresh (torch, transformers and kv4rl cost ~10 s of CPU per process; a 4-rank job
# on 2 cores paid that 4 times, ~20 s of wall time per job). The forkserver runs no test code, so a rank
# still starts from a clean interpreter, as a spawned one does: only the imports are done already. As
# with spawn, a rank takes the caller's working directory and sys.path; it also takes the caller's
# environment (the forkserver keeps the one it started with) and hands its output back to the caller
# (the forkserver's stdout and stderr are those of the test that started it). What a rank runs and
# returns is unchanged.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "transformers", "transformers.models.qwen3.modeling_qwen3", "safetensors.torch", "pytest",
           "kv4rl.loop", "kv4rl.split.run", "kv4rl.cli"]


COLLECTIVE_TIMEOUT_S = 240


def _log_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.log")


def _rank_main(rank: int, world: int, port: int, out_dir: str, environ: dict, fn, args: tuple) -> None:
    import torch.distributed as dist

    log = os.open(_log_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    # a collective that never pairs up (ranks out of step) fails the test in minutes instead of gloo's 30
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gloo_ranks(fn, world: int, out_dir, *args) -> list:
    """`fn(rank, *args)` on each of `world` ranks (a module-level function); their results in rank
    order. What the ranks printed goes to this process's stderr (pytest shows it with a failure)."""
    out_dir = str(out_dir)
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    try:
        mp.start_processes(_rank_main, args=(world, _free_port(), out_dir, dict(os.environ), fn, args),
                           nprocs=world, start_method="forkserver")
    finally:
        for rank in range(world):
            if os.path.exists(path := _log_path(out_dir, rank)):
                with open(path, errors="replace") as log:
                    text = log.read()
                os.remove(path)
                if text:
                    sys.stderr.write(f"--- rank {rank} of {world} ---\n{text}")
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]
