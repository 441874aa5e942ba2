"""A verl reward function as a kv4rl reward: verl's `custom_reward_function` is a `compute_score(data_source,
solution_str, ground_truth, extra_info)` called once per response, returning a score or a dict with a `score`.
`VerlScore` calls it as verl's naive reward manager does, with `data_source` and `extra_info` from the row's own
columns (a verl Parquet row keeps them in `Problem.meta`), so a verl user's scorer trains here unchanged."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from kv4rl.rewards.base import Reward, RewardResult
from kv4rl.rewards.watchdog import WatchdogWorker, resolve

__all__ = ["VerlScore"]

_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # what verl's naive manager passes


class VerlScore(Reward):
    """`compute_score` per response: the response's text as `solution_str`; the row's `reward_model.ground_truth` as
    the file holds it (a number stays a number, as verl hands it; a row without one, its gold answer's text); its
    `data_source` (None where the file has none); and a copy of its `extra_info` ({} where none) with verl's
    `num_turns` (None: one turn) and `rollout_reward_scores` ({}). Only the arguments the function names are passed:
    verl's own scorers (`gsm8k.compute_score(solution_str, ground_truth, ...)`) take two of the four. A bool scores
    1.0 / 0.0 (verl writes it into a float tensor). A dict result gives its `score`; its other keys with a number
    (or a bool) are summed over the batch into the stats as `<key>_sum` (logged `reward_<key>_sum`, a count for
    verl's `acc`), where verl keeps them per response for its validation means; text values are dropped. With
    `timeout_s` each call runs in a watchdogged worker process (`kv4rl.rewards.watchdog`, as `math_verify`'s checks
    do): one past the limit scores 0 and counts in `timeouts`, and the worker is restarted; compute_score must then
    be a module-level function the worker can import, and its arguments and result picklable."""

    takes_problems = True

    def __init__(self, compute_score: Callable[..., Any], timeout_s: float | None = None):
        self.compute_score = compute_score
        self.worker = None if timeout_s is None else WatchdogWorker(
            _import_path(compute_score), timeout_s=timeout_s, label="VerlScore", what="compute_score")
        params = inspect.signature(compute_score).parameters
        self.passed = None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set(params) & set(_ARGUMENTS)
        by_position = [name for name, p in params.items() if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if by_position:
            raise ValueError(f"compute_score takes {', '.join(by_position)} by position only; a verl reward manager "
                             f"passes {', '.join(_ARGUMENTS)} by name: drop the '/' from its signature, or wrap it")
        needed = [name for name, p in params.items() if p.default is p.empty and name not in _ARGUMENTS
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if needed:
            raise ValueError(f"compute_score needs {', '.join(needed)}, which a verl reward manager does not pass (it "
                             f"passes {', '.join(_ARGUMENTS)} by name): give those a default, or wrap the function")

    def score(self, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
        metas = [getattr(p, "meta", None) or {} for p in problems] if problems is not None else [{}] * len(responses)
        scores, sums, calls = [], {}, []
        for i, (response, gold, meta) in enumerate(zip(responses, golds, metas, strict=True)):
            given = meta.get("extra_info")
            if given is not None and not isinstance(given, dict):
                where = f"problem {problems[i].id}" if problems is not None else f"response {i}"
                raise ValueError(f"{where}: its extra_info is {type(given).__name__} {given!r:.60}, where verl's is a "
                                 "dict (its reward manager adds num_turns to it)")
            extra_info = dict(given or {})
            extra_info.update(num_turns=None, rollout_reward_scores={})  # what verl's manager adds, single-turn
            written = meta.get("reward_model")  # a verl row's own: a number stays a number, as verl hands it
            truth = written["ground_truth"] if isinstance(written, dict) and "ground_truth" in written else gold
            arguments = {"data_source": meta.get("data_source"), "solution_str": response, "ground_truth": truth,
                         "extra_info": extra_info}
            calls.append({k: v for k, v in arguments.items() if self.passed is None or k in self.passed})
        outs = self._outcomes(calls, len(responses), sums)
        for i, out in enumerate(outs):
            if isinstance(out, dict):
                if "score" not in out:
                    raise ValueError(f"compute_score returned a dict without 'score' for response {i} of "
                                     f"{len(responses)} (keys {sorted(out)}); verl reads the reward from 'score'")
                for key, value in out.items():
                    number = _number(value) if key != "score" else None
                    if number is not None:
                        sums[f"{key}_sum"] = sums.get(f"{key}_sum", 0.0) + number
                out = out["score"]
            if type(out).__name__ in ("bool", "bool_"):  # verl writes it into a float tensor: True is 1.0
                out = float(out)
            scores.append(out)
        return RewardResult(scores, sums)

    def _outcomes(self, calls: list[dict], n: int, sums: dict[str, float]) -> list[Any]:
        """compute_score of each call: in this process, or with `timeout_s` in the watchdogged worker, where a call
        past the limit scores 0 (counted in `timeouts`, logged `reward_timeouts`) and an error stops the run as
        it would in this process."""
        if self.worker is None:
            return [self.compute_score(**kwargs) for kwargs in calls]
        outcomes = self.worker.call_all([(i, (), kwargs) for i, kwargs in enumerate(calls)],
                                        shown=lambda item: repr(item[2].get("solution_str", ""))[:200])
        sums["timeouts"] = float(sum(kind == "timeout" for kind, _ in outcomes.values()))
        for i in range(n):
            kind, value = outcomes[i]
            if kind == "error":
                raise RuntimeError(f"compute_score failed on response {i} of {n}: {value}")
        return [0.0 if outcomes[i][0] == "timeout" else outcomes[i][1] for i in range(n)]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _import_path(fn: Callable[..., Any]) -> str:
    """`module:qualname` of a function a spawned worker can import, or a ValueError that says why not."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(f"VerlScore(timeout_s=...) runs compute_score in a worker process, which imports it by "
                         f"name: {module}:{name or fn!r} cannot be imported there (a lambda, a nested function or "
                         f"one of the main script); define it at the top level of a module on the Python path")
    path = f"{module}:{name}"
    if resolve(path) is not fn:
        raise ValueError(f"VerlScore(timeout_s=...): {path} does not name the compute_score given (it was "
                         "replaced or wrapped); pass the module-level function itself")
    return path


def _number(value: Any) -> float | None:
    """A compute_score value as a finite number: Python's or NumPy's numbers and bools (verl's scorers return
    `np.bool_` / `np.float32`, which verl's np.mean reads), a one-element tensor; None for text and the rest."""
    if value is None or isinstance(value, str | bytes):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # a list, a dict, a many-element array, 10**400
        return None
    return number if math.isfinite(number) else None
