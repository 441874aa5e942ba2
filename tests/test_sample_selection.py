"""Which samples are trained and how stale they are, where a mutation of the code passed every other test
(QA): the training stream's order and coverage, `max_versions` reached and never passed, distinct seeds for
re-sampled responses, a resume that keeps their attempt counts, per-token staleness, each row's advantage."""

import collections
import json
from types import SimpleNamespace

import pytest

from kv4rl.data.source import ProblemSource
from kv4rl.engine.sequence import Completion
from kv4rl.rollout.config import StalenessConfig
from kv4rl.rollout.pipeline import RolloutPipeline
from kv4rl.telemetry.run_stats import staleness_stats
from kv4rl.trainer.batch import build_batch
from tests.test_rollout import make_collector, restored

N = 20


@pytest.fixture
def twenty_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"{i}+1", "answer": str(i + 1)}) + "\n"
                            for i in range(N)))
    return str(path)


def _epochs(source: ProblemSource, size: int, count: int = 3) -> list[list[str]]:
    return [[source.problem_at(e * size + k).problem for k in range(size)] for e in range(count)]


def test_each_pass_over_a_file_is_a_permutation_shuffled_afresh_or_in_file_order(twenty_rows):
    rows = [f"{i}+1" for i in range(N)]
    shuffled = _epochs(ProblemSource(twenty_rows, None, seed=0, shuffle=True), N)
    assert all(sorted(e) == sorted(rows) for e in shuffled)  # every problem once per pass
    assert shuffled[0] != rows and shuffled[0] != shuffled[1] != shuffled[2]  # a fresh order each pass
    assert _epochs(ProblemSource(twenty_rows, None, seed=0, shuffle=False), N) == [rows] * 3
    assert _epochs(ProblemSource(twenty_rows, None, seed=1, shuffle=True), N) != shuffled  # the seed's own


def test_the_embedded_default_trains_on_its_pool_each_pass_covering_it_once():
    source = ProblemSource(None, None, seed=0)  # data.pool_size 512
    pool = sorted(p.problem for p in source.train)
    assert len(pool) == 512
    first, second = _epochs(source, 512, 2)
    assert sorted(first) == pool and sorted(second) == pool and first != second


def test_fresh_embedded_problems_do_not_repeat_chunk_after_chunk():
    source = ProblemSource(None, None, seed=0, pool_size=0)
    first, second = _epochs(source, 1024, 2)
    assert first != second and len(set(first) & set(second)) < 512


def test_staleness_is_counted_per_token():
    """By hand at update 5: versions [3, 4, 5] and [5, 5] are tokens 2, 1, 0, 0, 0 updates old."""
    stats = staleness_stats(5, [SimpleNamespace(versions=[3, 4, 5]), SimpleNamespace(versions=[5, 5])])
    assert stats == {"staleness_mean": pytest.approx(0.6), "staleness_max": 2,
                     "staleness_hist": {"0": 3, "1": 1, "2": 1}}  # JSON keys: strings


def test_each_row_of_a_learner_batch_carries_its_own_advantage_and_versions():
    batch = build_batch([[1, 2], [3]], [[5, 6], [7, 8, 9]], [[-0.1, -0.2], [-0.3, -0.4, -0.5]],
                        [[0, 1], [2, 2, 3]], [1.5, -0.5], pad_id=0)
    mask = batch.response_mask.bool()
    assert mask.sum(1).tolist() == [2, 3]
    assert batch.advantages[0][mask[0]].tolist() == [1.5, 1.5]
    assert batch.advantages[1][mask[1]].tolist() == [-0.5, -0.5, -0.5]
    assert batch.versions[1][mask[1]].tolist() == [2, 2, 3]
    assert batch.behavior_logprobs[1][mask[1]].tolist() == pytest.approx([-0.3, -0.4, -0.5])


def _long_every_third(g, j):
    return 30 if g % 3 == 0 else 2


def _run(path, staleness, updates=12, **kw):
    """Partial rollout for `updates` updates; returns token ages of the delivered batches, the batches, and the
    responses the pipeline aborted as too stale."""
    col = make_collector(path, _long_every_third, mode="partial", quota=2, group=2, slots=4, **kw)
    pipe = RolloutPipeline(col, staleness)
    real_abort, aborted = col.engine.abort, []
    col.engine.abort = lambda seq: (aborted.append(list(Completion.from_sequence(seq).versions)), real_abort(seq))[1]
    ages, batches = collections.Counter(), []
    for u in range(updates):
        batch = pipe.next_batch()
        batches.append(batch)
        ages.update(u - v for g in batch for c in g.completions for v in c.versions)
        refresh = pipe.refresh_due(u)
        if refresh:
            col.engine.load_weights(col.engine.weights_state(), version=u + 1)
        pipe.after_update(u, refresh)
    return col, ages, batches, aborted


@pytest.mark.parametrize("staleness,bound", [(StalenessConfig(max_versions=1), 1),
                                             (StalenessConfig(lag=1, refresh_every=2, max_versions=2), 2)])
def test_max_versions_is_reached_and_never_passed(tiny_qwen3, staleness, bound):
    """A bound of 1 trained tokens one update old (a `>=` dropped them all: every carried response was thrown
    away, long ones most, biasing the batch to short responses); none is older than the bound."""
    path, _ = tiny_qwen3
    col, ages, batches, aborted = _run(path, staleness)
    assert max(ages) == bound and col.num_dropped > 0, (dict(ages), col.num_dropped)
    assert aborted  # what was dropped had tokens of an older version than any delivered one
    # re-sampled responses draw with seeds of their own: no two responses of a group are the same tokens
    for batch in batches:
        for g in batch:
            ids = [tuple(c.token_ids) for c in g.completions]
            assert len(set(ids)) == len(ids), g.index


def test_a_resume_keeps_each_responses_resample_count(tiny_qwen3):
    """Saved and restored after update k, the pipeline delivers the batches of the uninterrupted run: a restore
    that forgot the attempt counts re-sampled a dropped response with its first attempt's seed again."""
    path, _ = tiny_qwen3
    staleness = StalenessConfig(max_versions=1)

    def build():
        col = make_collector(path, _long_every_third, mode="partial", quota=2, group=2, slots=4, carry="recompute")
        return col, RolloutPipeline(col, staleness)

    def run(save_after=None, updates=10):
        (col, pipe), out = build(), []
        for u in range(updates):
            out.append([(g.index, [tuple(c.token_ids) for c in g.completions]) for g in pipe.next_batch()])
            col.engine.load_weights(col.engine.weights_state(), version=u + 1)
            pipe.after_update(u, True)
            if u == save_after:
                col, pipe = restored(pipe, build, u + 1)
        return out, col.num_dropped

    whole, dropped = run()
    assert dropped > 0
    for save_after in (3, 5):
        assert run(save_after)[0] == whole, save_after
