"""The engine's weights: learner weights loaded in place with their version, KV calibration for a checkpoint,
the engine's own weights saved and restored. `Engine` takes them as a mixin; a load that stops part-way
marks the weights torn, and `step` / `score_tokens` refuse to run on them (`_check_weights_whole`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from kv4rl.engine.merged_linears import merged_state_dict, unmerged_state_dict


class EngineWeights:
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Copy learner weights (HF names: a state dict, or a stream of (name, tensor) such as
        `Learner.full_weights()`) in place; tokens sampled afterwards carry `version`. FP8 linears
        re-quantize from the incoming tensors as they are copied. Returns once the copies are done on
        the device, so the loop's `time_sync` holds the whole refresh. A state dict is checked whole before
        anything is copied, so a refused one changes nothing. A stream is copied as it comes: one that fails
        part-way (a missing or misshapen tensor) leaves the weights part old, part new, and the engine then
        refuses to step or score until a whole set loads (holding a second copy would double the weights)."""
        if not isinstance(version, int) or isinstance(version, bool):  # it tags every later token
            raise ValueError(f"load_weights: version must be an int, got {version!r}")
        if isinstance(weights, Mapping):  # what the names-and-shapes check cannot see: a copy failing half-way
            odd = next(((k, v) for k, v in weights.items() if not isinstance(v, torch.Tensor) or v.is_meta
                        or not (v.is_floating_point() or v.is_complex())), None)
            if odd is not None:
                what = (type(odd[1]).__name__ if not isinstance(odd[1], torch.Tensor) else
                        "a meta tensor (no data)" if odd[1].is_meta else f"a {odd[1].dtype} tensor")
                raise ValueError(f"load_weights: {odd[0]} is {what}; weights are floating-point tensors with data")
        self.drain()  # a step in flight samples under the old weights, with the old version
        self.scheduler.forget_prefixes()  # later requests must not reuse prompt KV of the old weights
        taken = [0]  # tensors the stream handed over to be copied; each is copied before the next is asked for

        def counted(stream):
            for item in stream:
                yield item
                if not self.model.ignorable(item[0]):  # skipped, not copied
                    taken[0] += 1

        checked_whole = isinstance(weights, Mapping)
        try:
            self.runner.load_weights(weights if checked_whole else counted(weights))
        except BaseException as exc:
            if (checked_whole and isinstance(exc, ValueError)) or (not checked_whole and taken[0] == 0):
                raise  # refused before any tensor was copied: the weights are as they were
            self._torn_weights = f"{type(exc).__name__}: {exc}"
            raise
        self.runner.synchronize()
        self.version = version
        self._torn_weights = None

    def kv_calibration(self) -> list[dict[str, torch.Tensor]] | None:
        """What the KV format calibrated once per layer (NVFP4's per-tensor scales), on the CPU, for a
        checkpoint; None for formats that calibrate nothing. A resumed engine given it (`load_kv_calibration`) quantizes
        its cache as the saved one did, instead of calibrating on other prompts."""
        per_layer = self.runner.kv_calibration()
        if not any(per_layer):
            return None
        return [{key: value.cpu() for key, value in kept.items()} for kept in per_layer]

    def load_kv_calibration(self, per_layer: list[dict[str, torch.Tensor]]) -> None:
        self.runner.load_kv_calibration([{key: value.to(self.device) for key, value in kept.items()}
                                         for kept in per_layer])

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The engine's weights under its own names, those of unmerged projections whether merged or not
        (`merged_linears.unmerged_state_dict`), on CPU (FP8 codes and scales stay exact)."""
        return {k: v.detach().cpu().clone() for k, v in unmerged_state_dict(self.model).items()}

    def load_weights_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Restore weights saved by `weights_state`; tokens sampled afterwards carry `version`."""
        self.drain()
        try:
            self.model.load_state_dict(merged_state_dict(self.model, state))
        except BaseException as exc:  # torch copies every matching tensor before it raises on a misshapen one
            self._torn_weights = f"{type(exc).__name__}: {exc}"
            raise
        self.version = version
        self._torn_weights = None
        self.scheduler.forget_prefixes()

    def _check_weights_whole(self) -> None:
        if self._torn_weights is not None:
            raise RuntimeError(f"the engine's weights are part old, part new: load_weights failed part-way "
                               f"({self._torn_weights}); load a whole set before sampling or scoring")
