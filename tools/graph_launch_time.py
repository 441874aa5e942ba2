"""Host time of `CUDAGraph.replay` when the device is behind: one graph replayed back to back against
two copies of it replayed in turn, at a decode step's node count.

The 1.7B KV4 rollout step spends 0.46-0.62 ms of host time a step in `cudaGraphLaunch` (profile,
twentieth session), for a graph of ~390 kernels. This says whether that is the launch's own work
(grows with nodes, same for one or two copies) or a wait for the previous replay of the same
executable graph (two copies replayed in turn would not wait):

    python tools/graph_launch_time.py --nodes 400 --kernel-us 10 --launches 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(nodes: int, elems: int, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `nodes` dependent elementwise kernels over `elems` floats."""
    x = torch.ones(elems, device=device)

    def run():
        y = x
        for _ in range(nodes):
            y = y.mul(1.0000001)
        return y

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def launch_times(graphs: list[torch.cuda.CUDAGraph], launches: int) -> tuple[list[float], float]:
    """Host microseconds of each replay (the graphs taken in turn) and the device's total ms."""
    torch.cuda.synchronize()
    times = []
    start = time.perf_counter()
    for i in range(launches):
        t = time.perf_counter()
        graphs[i % len(graphs)].replay()
        times.append(1e6 * (time.perf_counter() - t))
    torch.cuda.synchronize()
    return times, 1e3 * (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="50,400")
    p.add_argument("--kernel-us", type=float, default=10.0, help="rough device time of one kernel")
    p.add_argument("--launches", type=int, default=30)
    p.add_argument("--profiler", action="store_true", help="replay under torch.profiler (CUDA activities), as "
                   "tools/profile_rollout_step.py does")
    args = p.parse_args()
    if args.profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            run(args)
    else:
        run(args)


def run(args) -> None:
    device = torch.device("cuda")
    # one elementwise kernel reads and writes 8 bytes an element at ~3 TB/s
    elems = max(1024, int(args.kernel_us * 1e-6 * 3e12 / 8))
    print(f"{'nodes':>6} {'copies':>6} {'graph ms':>9} {'replay us: median':>18} {'max':>9} {'device ms total':>16}")
    for nodes in (int(n) for n in args.nodes.split(",")):
        built = [build(nodes, elems, device) for _ in range(2)]
        for copies in (1, 2):
            graphs = [g for g, _ in built[:copies]]
            launch_times(graphs, 4)  # warm
            times, total = launch_times(graphs, args.launches)
            print(f"{nodes:>6} {copies:>6} {total / args.launches:>9.3f} {statistics.median(times):>18.1f} "
                  f"{max(times):>9.1f} {total:>16.2f}")


if __name__ == "__main__":
    main()
