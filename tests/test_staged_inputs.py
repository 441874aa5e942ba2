"""A CUDA graph's inputs staged through one pinned mirror and one copy (`StagedInputs`), and the decode
graphs' step packing (`DecodeGraphs.load`), on CPU: the device views after each step equal the rows and
padding written out by hand, across mirror reuse, buckets that shrink and grow, and device-side ids."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import torch

if not torch.cuda.is_available():  # the import below loads the Triton kernels: interpret them, as other CPU tests do
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv4rl.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from kv4rl.engine.staged_inputs import ALIGN, StagedInputs  # noqa: E402


def test_fields_are_aligned_disjoint_views_and_one_upload_moves_the_written_prefix():
    staged = StagedInputs({"a": ((3,), torch.int64, 7), "b": ((5,), torch.int32, -1), "c": ((2, 4), torch.int32, 0)},
                          "cpu")
    assert staged.offsets == {"a": 0, "b": 32, "c": 64}  # 24 -> 32, 20 -> 32 bytes
    assert staged.nbytes == 96 and all(o % ALIGN == 0 for o in staged.offsets.values())
    assert staged["a"].tolist() == [7, 7, 7] and staged["b"].tolist() == [-1] * 5 and staged["c"].sum() == 0
    assert staged.end("c", 3) == 64 + 12

    rows = staged.host()
    rows["a"][:] = [1, 2, 3]
    rows["b"][:2] = [10, 11]
    rows["c"][0, :] = [4, 5, 6, 8]
    rows["c"][1, :] = 9
    staged.upload(staged.end("c", 5))  # c's first row and one element of its second
    assert staged["a"].tolist() == [1, 2, 3]
    assert staged["b"].tolist() == [10, 11, -1, -1, -1]
    assert staged["c"].tolist() == [[4, 5, 6, 8], [9, 0, 0, 0]]
    staged.upload(staged.nbytes)  # the other mirror: still its initial values
    assert staged["a"].tolist() == [7, 7, 7] and staged["c"].sum() == 0
    assert staged.host()["a"].tolist() == [1, 2, 3]  # the first mirror again, as the first step left it
    assert staged.num_copies == 2


class _Planner(SimpleNamespace):
    """What `DecodeGraphs.load` asks of `FastAttention`: the device and the step's split size."""

    def step_split_size(self, context_lens, batch_size):
        return int(context_lens.max()) + 1000 * batch_size


def _host(n: int, width: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(1, 1000, n), "positions": rng.integers(0, 50, n), "slots": rng.integers(0, 400, n),
            "protect_rows": rng.integers(-1, 30, n), "context_lens": rng.integers(1, 50, n).astype(np.int32),
            "seq_slots": rng.permutation(40)[:n].astype(np.int32),
            "block_tables": rng.integers(0, 100, (n, width)).astype(np.int32)}


def test_decode_graph_load_writes_rows_then_padding_up_to_the_bucket():
    graphs = DecodeGraphs(None, [], _Planner(device=torch.device("cpu")), max_batch=32, max_blocks=6)
    padding = {"ids": 0, "positions": 0, "slots": -1, "protect_rows": -1, "context_lens": 0, "seq_slots": 0}
    steps = [(13, 4, 16, None), (16, 2, 16, torch.arange(100, 116)), (3, 6, 4, None), (5, 5, 8, None)]
    for seed, (n, width, bs, pending) in enumerate(steps):
        host = _host(n, width, seed)
        assert graphs.bucket(n) == bs
        graphs.load(host, bs, pending)
        for name, pad in padding.items():
            want = (pending.numpy() if name == "ids" and pending is not None else host[name]).tolist()
            assert getattr(graphs, name)[:bs].tolist() == want + [pad] * (bs - n), (seed, name)
        assert graphs.block_tables[:n, :width].tolist() == host["block_tables"].tolist()
        assert graphs.split_size.item() == host["context_lens"].max() + 1000 * bs
    assert graphs.staged.num_copies == len(steps)
