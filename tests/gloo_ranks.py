"""Run a function on N CPU processes joined by a gloo process group (tests of the distributed code)."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gloo_ranks(fn, world: int, out_dir, *args) -> list:
    """`fn(rank, *args)` on each of `world` spawned ranks (a module-level function); their results in
    rank order."""
    mp.start_processes(_rank_main, args=(world, _free_port(), str(out_dir), fn, args), nprocs=world,
                       start_method="spawn")
    return [torch.load(os.path.join(str(out_dir), f"rank{rank}.pt")) for rank in range(world)]
