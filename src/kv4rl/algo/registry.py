"""The policy-loss plug-in contract: what a loss receives, what it declares, and the registry.

A loss is a function `fn(inp: LossInputs, cfg: AlgoConfig) -> (loss, metrics)` registered with
`@register_loss(name, settings=..., inputs=...)`:

- `settings`: a dataclass of the loss's own knobs (every field with a default). Each field is a
  config key `algo.<field>` and reads back as `cfg.<field>`; a key belongs to exactly one loss, so
  a run config that sets another loss's key is refused with the name of the loss that owns it.
  An optional `validate()` method raises ValueError naming `algo.<field>` for bad values (run for every loss's
  settings), an optional `check_in_use()` for the rules that hold only when the loss is the run's, and an optional
  `ignored_in_use()` listing its own keys set but unread in the run's setting (warned at start).
- `inputs`: which optional `LossInputs` fields the loss reads (names in `LOSS_INPUTS`), as a set or
  as a function of the config. The learner computes and passes only those; the others stay None,
  so an extra forward pass (old or reference log-probs) is paid only by the losses that use it.

`logprobs`, `advantages` and `mask` are always given. The registry lives here rather than in
`losses` so that a loss written outside the package imports only this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kv4rl.algo.config import AlgoConfig

LOSS_INPUTS: dict[str, str] = {
    "behavior_logprobs": "log μ of each sampled token, as reported by the rollout engine",
    "old_logprobs": "log π_old: the learner's own log-probs before this batch's first update (one extra forward)",
    "ref_logprobs": "log π_ref of the frozen reference policy (one extra forward; given when the run has one)",
    "versions": "policy version that sampled each token (an integer tensor)",
    "sampled_mask": "every token the engine sampled, those algo.behavior_rs rejected too (`mask` holds the trained ones)",
    "behavior_is_norm": "the learner batch's mean behaviour weight, in every position (algo.behavior_is_normalize)",
}
# algo keys every loss shares
COMMON_KEYS = ("loss", "loss_agg", "loss_norm_tokens", "kl_ref_coef", "kl_ref_type", "kl_ref_clamp", "entropy_coeff",
               "entropy_target", "entropy_coeff_delta", "entropy_coeff_min", "entropy_coeff_max", "top_entropy_quantile",
               "plugins")


@dataclass(kw_only=True)
class LossInputs:
    """One (micro-)batch, `[B, T]` tensors. `num_tokens`/`num_seqs`: full-batch denominators, `norm_tokens`
    `token_sum_norm`'s constant length (see aggregation; `aggregate()` passes all three). The optional
    tensors are those of `LOSS_INPUTS`; a loss reads a declared one through `need()`, which says which
    loss input is missing instead of failing on None.
    """

    logprobs: Tensor  # learner log π_θ at temperature τ, with grad
    advantages: Tensor
    mask: Tensor  # float or bool, nonzero at valid tokens
    behavior_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    versions: Tensor | None = None
    sampled_mask: Tensor | None = None
    behavior_is_norm: Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_tokens: float | None = None
    keep: Tensor | None = None  # the tokens whose terms count (algo.top_entropy_quantile); denominators count all

    def aggregate(self, values: Tensor, valid: Tensor, mode: str, filtered: bool = True) -> Tensor:
        """`values [B, T]` reduced over `valid` by `mode` (`algo.loss_agg`) with this batch's denominators; a token
        outside `keep` adds 0 (and no gradient) but still counts in them, unless not `filtered` (the reference KL,
        which TRL adds after its entropy mask)."""
        from kv4rl.algo.aggregation import aggregate

        if self.keep is not None and filtered:
            values = torch.where(self.keep.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
        return aggregate(values, valid, mode, self.num_tokens, self.num_seqs, self.norm_tokens)

    def need(self, name: str, why: str = "") -> Tensor:
        """The optional input `name`, or a ValueError that names it (and `why` it is needed)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"LossInputs.{name} is missing" + (f" ({why})" if why else ""))
        return value

    def valid_mask(self) -> Tensor:
        """Check shapes; return the bool mask."""
        shape = self.logprobs.shape
        if len(shape) != 2:
            raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
        for name in ("advantages", "mask", *LOSS_INPUTS):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}")
        return self.mask.bool()


LossFn = Callable[[LossInputs, "AlgoConfig"], tuple[Tensor, dict[str, float]]]
InputsDecl = Iterable[str] | Callable[["AlgoConfig"], Iterable[str]]


# what the learner logs under its own names beside a loss's metrics (a loss's `grad_norm` was averaged into the
# real norm, its `loss` silently replaced)
LEARNER_METRICS = frozenset({"loss", "grad_norm", "skipped_steps", "empty_steps", "num_tokens", "lr", "entropy", "mismatch_abs_mean",
                             "mismatch_absmax"})


def _checked_output(name: str, output) -> tuple[Tensor, dict[str, float]]:
    """A loss's `(loss, metrics)` as the learner needs it, or a ValueError naming the loss and what it gave (a
    list, a float, a [B, T] tensor or a detached one each failed deep in backward() with a traceback)."""
    if not (isinstance(output, tuple) and len(output) == 2):
        raise ValueError(f"loss '{name}' returned {type(output).__name__}; it must return (loss, metrics): a scalar "
                         f"tensor and a dict of numbers")
    loss, metrics = output
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = (type(loss).__name__ if not isinstance(loss, Tensor) else
                f"a tensor of shape {tuple(loss.shape)}" if loss.dim() else "a tensor without a gradient (detached?)")
        raise ValueError(f"loss '{name}' returned {what} as its loss; it must be a scalar tensor that requires grad")
    if not isinstance(metrics, dict):
        raise ValueError(f"loss '{name}' returned metrics of type {type(metrics).__name__}; they must be a dict")
    for key, value in metrics.items():
        if key in LEARNER_METRICS:
            raise ValueError(f"loss '{name}' returned a metric '{key}', a name the learner logs itself; rename it")
        if isinstance(value, Tensor) and value.numel() == 1:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"loss '{name}' returned metric '{key}' = {value!r}; a metric must be a number")
    return loss, metrics


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: call it like the function; ask `inputs(cfg)` what to compute for it."""

    name: str
    fn: LossFn
    settings: type | None = None
    declared_inputs: InputsDecl = ()

    def __call__(self, inp: LossInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
        return _checked_output(self.name, self.fn(inp, cfg))

    def inputs(self, cfg: AlgoConfig) -> frozenset[str]:
        """The optional `LossInputs` fields this loss reads under `cfg`."""
        declared = self.declared_inputs(cfg) if callable(self.declared_inputs) else self.declared_inputs
        names = frozenset(declared)
        _check_input_names(self.name, names)
        return names

    def keys(self) -> tuple[str, ...]:
        """The loss's own `algo.*` keys."""
        return tuple(f.name for f in dataclasses.fields(self.settings)) if self.settings else ()


LOSSES: dict[str, LossSpec] = {}


def _check_input_names(loss: str, names: Iterable[str]) -> None:
    unknown = sorted(set(names) - LOSS_INPUTS.keys())
    if unknown:
        raise ValueError(f"loss '{loss}' declares unknown inputs {unknown} (known: {', '.join(LOSS_INPUTS)})")


def _check_settings(name: str, settings: type) -> None:
    """Refuse at registration what would fail later: a default of another type than its annotation was written
    to config.yaml and then refused by the run's own --resume; a frozen dataclass or a field named like the
    algo section's own attributes (`validate`, `_sections`) failed with a traceback, or at resume."""
    import sys
    import typing

    from kv4rl.config_loader import ConfigError, coerce_value

    # the built-in losses register while kv4rl.algo.config is being imported; every plug-in after it is there
    section = getattr(sys.modules.get("kv4rl.algo.config"), "AlgoConfig", None)

    if not dataclasses.is_dataclass(settings):
        raise ValueError(f"loss '{name}': settings must be a dataclass, got {settings!r}")
    if not isinstance(settings, type):  # an instance passed is_dataclass, then every config check failed
        raise ValueError(f"loss '{name}': settings must be the dataclass itself, not an instance of it: "
                         f"settings={type(settings).__name__}, not {settings!r}")
    if settings.__dataclass_params__.frozen:
        raise ValueError(f"loss '{name}': settings must not be a frozen dataclass (overrides set its fields)")
    try:
        hints = typing.get_type_hints(settings)
    except Exception as exc:  # noqa: BLE001 - an annotation that names nothing importable
        raise ValueError(f"loss '{name}': the annotations of {settings.__name__} cannot be resolved ({exc})") from None
    for f in dataclasses.fields(settings):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"loss '{name}': setting 'algo.{f.name}' needs a default")
        owner = "all losses" if f.name in COMMON_KEYS else key_owner(f.name)
        if owner is not None:
            raise ValueError(f"loss '{name}': key 'algo.{f.name}' already belongs to {owner!r}")
        if f.name.startswith("_") or (section is not None and hasattr(section, f.name)):
            raise ValueError(f"loss '{name}': setting 'algo.{f.name}' is named like the algo section's own "
                             f"attributes; rename it")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        try:
            coerce_value(default, hints[f.name], f"algo.{f.name}")
        except ConfigError as exc:
            raise ValueError(f"loss '{name}': the default of setting 'algo.{f.name}' is not of its type ({exc}); "
                             f"a run's config.yaml records it and its --resume would refuse it") from None
        except TypeError as exc:  # an annotation no config value can have
            raise ValueError(f"loss '{name}': setting 'algo.{f.name}': {exc}") from None


def register_loss(name: str, *, settings: type | None = None, inputs: InputsDecl = ()) -> Callable[[LossFn], LossFn]:
    """Decorator: make `fn` selectable as `algo.loss=<name>` (see the module docstring)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"loss name must be an identifier, got {name!r}")
    if name in LOSSES:
        raise ValueError(f"loss '{name}' is already registered")
    if settings is not None:
        _check_settings(name, settings)
    if not callable(inputs):
        inputs = frozenset(inputs)
        _check_input_names(name, inputs)

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss '{name}' is already registered")
        LOSSES[name] = LossSpec(name, fn, settings, inputs)
        return fn

    return wrap


def require_choice(key: str, value: object, choices: Iterable) -> None:
    """For a settings `validate()`: a ValueError naming `key` unless `value` is one of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}' (registered: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]


def key_owner(key: str) -> str | None:
    """The registered loss whose settings hold `key`, or None."""
    return next((spec.name for spec in LOSSES.values() if key in spec.keys()), None)


def import_plugins(modules: Iterable[str]) -> None:
    """Import the modules named in `algo.plugins`; importing one runs its `register_loss` calls.

    Python caches imports, so naming a module twice, or in a reloaded run config, registers once.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            if isinstance(exc, ModuleNotFoundError) and missing and not _is_module_or_parent(missing, module):
                raise ValueError(f"algo.plugins: {module!r} was found, but importing it failed: {exc}") from exc
            raise ValueError(f"algo.plugins: cannot import {module!r} ({exc}); is it on the Python path?") from exc
        except ValueError as exc:  # a registration it makes refused (a duplicate name, a bad setting)
            raise ValueError(f"algo.plugins: importing {module!r}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - its own code failed as it ran: a SyntaxError, a NameError...
            where = (f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else
                     "".join(f" ({frame.filename}, line {frame.lineno})"
                             for frame in traceback.extract_tb(exc.__traceback__)[-1:]))
            raise ValueError(f"algo.plugins: importing {module!r} failed: {type(exc).__name__}: {exc}{where}") \
                from exc


def _is_module_or_parent(name: str, module: str) -> bool:
    """Whether `name` is `module` or a package it sits in (then `module` itself was not found)."""
    return module == name or module.startswith(name + ".")
