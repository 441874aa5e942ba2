"""The one-process behaviour of `kv4rl.distributed` and the merge of the ranks' metrics rows (by hand)."""

import os
import signal
import sys

import pytest

from kv4rl.distributed import Ranks, any_rank, current, gather_objects, merge_rank_rows


def test_without_torchrun_everything_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert current() == Ranks(0, 1)  # also when a learner test made its one-process group
    assert gather_objects({"a": 1}) == [{"a": 1}]
    assert any_rank(True) and not any_rank(False)
    assert Ranks().main and not Ranks(1, 2).main


def test_merge_rank_rows_by_hand():
    a = {"iteration": 3, "groups": [0, 2], "reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 100.0,
         "preemptions": 1, "time_rollout": 2.0, "staleness_max": 1, "mismatch_absmax": 0.3,
         "staleness_hist": {"0": 5, "1": 2}, "loss": 0.1, "note": "x", "eval/mean@1": None, "skipped_steps": 1}
    b = {"iteration": 3, "groups": [1, 3], "reward_mean": 1.0, "accuracy": 0.75, "tokens_per_s": 50.0,
         "preemptions": 2, "time_rollout": 3.0, "staleness_max": 2, "mismatch_absmax": 0.1,
         "staleness_hist": {"1": 1, "2": 4}, "loss": 0.1, "note": "y", "eval/mean@1": None, "skipped_steps": 1}
    merged = merge_rank_rows([a, b])
    assert merged["groups"] == [0, 1, 2, 3]
    assert merged["skipped_steps"] == 1 and type(merged["skipped_steps"]) is int  # the job's steps, not a mean
    assert merged["reward_mean"] == pytest.approx(0.75) and merged["accuracy"] == pytest.approx(0.5)
    assert merged["tokens_per_s"] == 150.0 and merged["preemptions"] == 3
    assert merged["time_rollout"] == 3.0 and merged["staleness_max"] == 2 and merged["mismatch_absmax"] == 0.3
    assert merged["staleness_hist"] == {"0": 5, "1": 3, "2": 4}
    assert merged["iteration"] == 3 and merged["loss"] == pytest.approx(0.1) and merged["note"] == "x"
    assert merged["eval/mean@1"] is None
    assert merge_rank_rows([a]) is a


def test_merged_phase_times_are_one_ranks_and_add_up_to_its_total():
    """Each phase's max over ranks summed to 3.5 s against a time_total of 3.2: plot iteration-time drew a
    negative `other` above the bar."""
    a = {"time_rollout": 2.0, "time_update": 1.0, "time_total": 3.1}
    b = {"time_rollout": 1.5, "time_update": 1.5, "time_total": 3.2}
    merged = merge_rank_rows([a, b])
    assert merged == b and merged["time_rollout"] + merged["time_update"] <= merged["time_total"]


def test_merged_stds_counts_and_staleness_mean_are_those_of_all_ranks_responses():
    """Rank a's rewards {0, 1}, rank b's {1, 1}: over all four the std is sqrt(3/16); the mean of the ranks'
    stds (0.5 and 0) was 0.25. Counts add (the mean halved them) and staleness_mean follows the merged hist."""
    a = {"reward_mean": 0.5, "reward_std": 0.5, "reward_no_answer": 1.0, "staleness_mean": 2 / 7,
         "staleness_hist": {"0": 5, "1": 2}}
    b = {"reward_mean": 1.0, "reward_std": 0.0, "reward_no_answer": 3.0, "staleness_mean": 9 / 5,
         "staleness_hist": {"1": 1, "2": 4}}
    merged = merge_rank_rows([a, b])
    assert merged["reward_mean"] == 0.75 and merged["reward_std"] == pytest.approx((3 / 16) ** 0.5, rel=1e-12)
    assert merged["reward_no_answer"] == 4.0
    assert merged["staleness_mean"] == pytest.approx((0 * 5 + 1 * 3 + 2 * 4) / 12, rel=1e-12)


def test_shutdown_frees_what_a_reference_cycle_still_holds_before_the_groups_go(monkeypatch):
    """An object in a reference cycle (as an engine holding its tensor-parallel group can be) is freed
    before the process groups are destroyed, not at interpreter exit after them."""
    import gc

    import kv4rl.distributed as distributed

    events = []

    class HoldsAGroup:
        def __del__(self):
            events.append("freed")

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: events.append("destroyed"))
    gc.disable()  # no automatic collection in between: only shutdown's own
    try:
        holder = HoldsAGroup()
        holder.cycle = holder
        del holder
        distributed.shutdown()
    finally:
        gc.enable()
    assert events == ["freed", "destroyed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rank_torchrun_started_asks_for_sigterm_when_torchrun_dies(world):
    """One rank too: torchrun --nproc-per-node 1 killed outright left its rank training on."""
    import subprocess
    from pathlib import Path

    import kv4rl

    code = ("import ctypes, signal; from kv4rl import distributed; distributed.stop_with_launcher() if "
            f"{world} > 1 else distributed.init_from_torchrun('cpu'); v = ctypes.c_int(); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)")
    env = dict(os.environ, PYTHONPATH=str(Path(kv4rl.__file__).parents[1]), TORCHELASTIC_RUN_ID="t", WORLD_SIZE=world)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(int(signal.SIGTERM)), out.stderr
    env.pop("TORCHELASTIC_RUN_ID")  # not started by torchrun: nothing asked
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out.stderr



def test_a_count_only_some_ranks_gave_adds_up_over_all():
    """A verl scorer returns `even` only where it parsed one, so rank 0's row lacked `reward_even_sum` that rank 1's
    had, and the merged row (rank 0's keys) dropped rank 1's 10; the others' keys keep their rules."""
    a = {"reward_mean": 0.5, "reward_acc_sum": 2.0, "loss": 1.0}
    b = {"reward_mean": 1.0, "reward_acc_sum": 3.0, "reward_even_sum": 10.0, "loss": 1.0, "grad_norm": 2.0}
    merged = merge_rank_rows([a, b])
    assert merged == {"reward_mean": 0.75, "reward_acc_sum": 5.0, "loss": 1.0, "reward_even_sum": 10.0,
                      "grad_norm": 2.0}
    assert merge_rank_rows([b, a])["reward_even_sum"] == 10.0
    assert merge_rank_rows([{"a": 1.0}, {"a": 1.0, "b": None}]) == {"a": 1.0, "b": None}  # was StopIteration
