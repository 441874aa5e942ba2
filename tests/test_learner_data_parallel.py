"""The data-parallel learner (FSDP2 over two gloo ranks on the CPU) against one process.

Each rank gets half of the learner batch's groups; the ranks normalise the loss by the global token
count and sum their gradients, so gradients and updated weights equal a single-process step on the
whole batch (fp32), also when packing gives the ranks different numbers of micro-batches, and when the
old policy's log-probs are recomputed (a sharded forward per micro-batch before the update).
"""

from __future__ import annotations

import pytest
import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.trainer.batch import build_batch
from kv4rl.trainer.learner import Learner
from tests.conftest import make_checkpoint
from tests.gloo_ranks import run_on_gloo_ranks

LENGTHS = [(5, 9), (5, 3), (7, 14), (7, 2), (4, 6), (4, 11), (6, 1), (6, 8)]  # (prompt, response) per row


def batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (p,), generator=g).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(0, 90, (r,), generator=g).tolist() for _, r in LENGTHS]
    behavior = [(-torch.rand(r, generator=g) * 3).tolist() for _, r in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    return build_batch(prompts, responses, behavior, [[0] * r for _, r in LENGTHS], adv, pad_id=0)


def learner(path, packed: bool, old_logprob: str = "behavior", algo: dict | None = None) -> Learner:
    return Learner(path, None, algo=AlgoConfig(old_logprob=old_logprob, **(algo or {})), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1e9,
                   micro_batch_size=2, updates_per_batch=1, temperature=1.0, device=torch.device("cpu"),
                   max_tokens_per_micro_batch=24 if packed else None)


def _step(path, rows, packed: bool, old_logprob: str = "behavior", algo: dict | None = None) -> dict:
    torch.manual_seed(0)
    lrn = learner(path, packed, old_logprob, algo)
    full = batch()
    metrics = lrn.step(full.select(torch.tensor(rows)))
    return {"grads": {k: v.detach().clone() for k, v in lrn.named_grads().items()},
            "weights": {k: v.detach().clone() for k, v in lrn.state_dict().items()}, "metrics": metrics,
            "micro_batches": len(lrn.micro_batches(full.select(torch.tensor(rows)), torch.arange(len(rows))))}


# the four longest responses on rank 0 (42 tokens), the four shortest on rank 1 (12): a loss normalised by
# each rank's own counts would weigh rank 1's tokens 3.5x theirs in one process
BY_LENGTH = sorted(range(len(LENGTHS)), key=lambda i: -LENGTHS[i][1])


def _half_batch_step(rank: int, path: str, packed: bool, old_logprob: str = "behavior", algo: dict | None = None,
                     uneven: bool = False) -> dict:
    half = len(LENGTHS) // 2
    order = BY_LENGTH if uneven else list(range(len(LENGTHS)))
    return _step(path, order[rank * half:(rank + 1) * half], packed, old_logprob, algo)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp-qwen3")
    make_checkpoint(path)
    return path


FUTURE_KL_SEQ_MEAN = {"loss": "future_kl", "loss_agg": "seq_mean", "horizon": 4, "is_mode": "sequence"}
DR_GRPO = {"loss_agg": "token_sum_norm", "loss_norm_tokens": 16}  # each rank's own 4 rows would double the step


@pytest.mark.parametrize("packed,old_logprob,algo,uneven", [
    (False, "behavior", None, False), (True, "behavior", None, False), (True, "recompute", None, False),
    (False, "behavior", None, True), (True, "behavior", FUTURE_KL_SEQ_MEAN, True), (False, "behavior", DR_GRPO, True)],
    ids=["padded", "packed", "packed-recompute", "padded-uneven-tokens", "packed-uneven-future-kl-seq-mean",
         "padded-uneven-token-sum-norm"])
def test_two_ranks_equal_one_process_on_the_whole_batch(checkpoint, tmp_path, packed, old_logprob, algo, uneven):
    single = _step(checkpoint, list(range(len(LENGTHS))), packed, old_logprob, algo)
    ranks = run_on_gloo_ranks(_half_batch_step, 2, tmp_path, str(checkpoint), packed, old_logprob, algo, uneven)
    if packed:  # the ranks' halves pack into different numbers of micro-batches: the dummy pass is exercised
        assert ranks[0]["micro_batches"] != ranks[1]["micro_batches"]
    for got in ranks:
        for name, grad in single["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
        for name, weight in single["weights"].items():
            # Adam's first step moves a weight by lr * g / (|g| + eps): about lr where |g| >> eps = 1e-8,
            # but where |g| is below eps the update follows the gradient's last digits, and the ranks'
            # sum of two halves rounds differently from one process (5.83e-9 against 5.87e-9 moved a
            # weight by 1.6e-5). A rounding difference dg of a gradient g moves the first step by about
            # lr * eps * dg / g^2 (3e-9 at g = 2e-7 moved a weight by 5e-6 with the old log-probs
            # recomputed), so the tight check holds where |g| > 1e-6 (there at most ~3e-7); everywhere a
            # weight must sit within lr / 100 of the single process (a missing or wrong step is ~lr off).
            moved = single["grads"][name].abs() > 1e-6 if name in single["grads"] else torch.ones_like(weight, dtype=torch.bool)
            torch.testing.assert_close(got["weights"][name][moved], weight[moved], rtol=1e-5, atol=1e-6, msg=name)
            if algo is None:  # future-KL's gradients are ~10x larger, and so are their rounding differences:
                # where |g| is ~1e-9 those move Adam's first step by more than lr / 100 (the gradients and the
                # weights where |g| > 1e-6 are checked above)
                torch.testing.assert_close(got["weights"][name], weight, rtol=0, atol=1e-2 / 100, msg=name)
        for key in ("loss", "grad_norm", "num_tokens", "entropy", "mismatch_abs_mean"):
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5), key
