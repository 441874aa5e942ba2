"""Typed config loading: YAML mappings and dotted overrides into nested dataclasses.

Every dataclass field's annotation is the schema, so there is no second list of keys to keep in
sync. Errors name the full dotted key, because a typo in a 40-key config is otherwise a silent
default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from kv4rl.config_foreign import OTHER_FRAMEWORKS, other_key_hint, other_value_hint
from kv4rl.config_yaml import AmbiguousNumber, StrictLoader, yaml_problem

_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# a value as a message shows it, cut short: a YAML alias's list pasted into one key once made a 5 MB error line
_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxlevel = 200, 200, 12, 12, 4


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another key. `problems` holds one line per
    problem (a config is checked whole, so a pasted foreign config hears of all its keys at once, not one a run)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems) if problems else [message]
        super().__init__("\n".join(self.problems))

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        return cls(problems[0], problems)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _quote_hint(value: Any, tp: Any, key: str) -> str:
    """A text key given `{problem}` or `Label: {x}` unquoted: YAML read a mapping, so say to quote it, in a
    form the shell passes on (it strips one level of quotes)."""
    wants_text = str in get_args(tp) or tp is str
    if wants_text and isinstance(value, list) and key.endswith(("data.train", "data.eval")):
        return " (a path, or a list of paths, each written as text)"
    if wants_text and isinstance(value, list) and key.endswith("model.path"):
        return " (one path: the folder of one model)"
    if wants_text and isinstance(value, (dict, list)):
        return (f" (the value was read as YAML, which made it a mapping or list; quote it for YAML: in a config "
                f"file {key.rsplit('.', 1)[-1]}: 'Q: {{problem}}', on the command line \"{key}='Q: {{problem}}'\", "
                f"the outer quotes for the shell)")
    return ""


NO_COUNTERPART = "no kv4rl counterpart known (README's 'Coming from ...' sections list the keys that have one)"


class _NotFinite(ConfigError):
    """A number that is inf or nan (its message is the one to show, whatever else the key may take)."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked against annotation `tp`, or raise ConfigError naming `key`."""
    origin = get_origin(tp)
    if origin is Literal:
        if any(value == arm and type(value) is type(arm) for arm in get_args(tp)):
            return value
        hint = other_value_hint(key, value)
        raise ConfigError(f"{key}: {_SHOWN.repr(value)} is not one of {_type_name(tp)}" + (f"; use {key}={hint}" if hint else ""))
    if origin in (typing.Union, types.UnionType):
        not_finite = None
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, key)
            except _NotFinite as e:  # `.nan` for a `float | None` key: say so, not "not of type float"
                not_finite = e
            except ConfigError:
                continue
        if not_finite is not None:
            raise not_finite
        raise ConfigError(f"{key}: {_SHOWN.repr(value)} is not of type {_type_name(tp)}{_quote_hint(value, tp, key)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {_SHOWN.repr(value)}")
    if _is_section(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {_SHOWN.repr(value)}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple:
        arms = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(arms):
            raise ConfigError(f"{key}: expected a list of {len(arms)} values, got {_SHOWN.repr(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, arms)))
    if origin is list:
        (arm,) = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_SHOWN.repr(value)}")
        return [_coerce(v, arm, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            number = float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string
        elif isinstance(value, str) and value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            number = float(value)  # `inf` is a string to YAML (`.inf` is its number): refused as one below
        if number is not None:
            if not math.isfinite(number):  # YAML's .inf / .nan: no setting means them (null turns one off)
                raise _NotFinite(f"{key}: expected a finite number, got {_SHOWN.repr(value)}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config annotation {tp!r} for {key}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_SHOWN.repr(value)}")


def coerce_value(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against annotation `tp` as a config file's value is (ConfigError naming `key`; TypeError
    for an annotation a config cannot hold)."""
    return _coerce(value, tp, key)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) or hasattr(tp, "config_schema")


def _schema(cls: type) -> dict[str, Any]:
    """Key -> annotation of a section: a dataclass's fields, or the keys a section whose keys depend
    on what is registered (`algo`: one set per loss) lists through `config_schema()`."""
    if hasattr(cls, "config_schema"):
        return cls.config_schema()
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# another section's only where the pasted path names it (prime-rl's monitors.wandb.name is not reward.name)
GENERIC_NAMES = frozenset({"name", "mode", "path", "type", "group_size"})


def _foreign_keys(key: str, value: Any, schema: dict[str, Any], prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted key, hint or None) for every leaf under `key` (a whole pasted verl path such as
    actor_rollout_ref.actor.clip_ratio_high=0.28, or a pasted verl section, arrives as one unknown top-level key):
    the hint where another framework names the leaf (or a section on its path, deepest first), or where its last
    name is a key of a kv4rl section (`schema`: the top level's)."""
    own = other_key_hint(key)
    if isinstance(value, dict) and value:
        found = [leaf for name, inner in value.items() for leaf in _foreign_keys(f"{key}.{name}", inner, schema, prefix)]
        return [(key, own)] if own is not None and all(hint is None for _, hint in found) else found
    if own is not None:
        return [(key, own)]
    names = key.split(".")
    last = names[-1]
    same = [f"{prefix}.{section}.{last}" if prefix else f"{section}.{last}"
            for section, tp in schema.items() if _is_section(tp) and last in _schema(tp)
            and (last not in GENERIC_NAMES or section in names[:-1])]
    return [(key, f"did you mean {' or '.join(same)}?" if same and "." in key else None)]


def _did_you_mean(name: str, schema: dict[str, Any], prefix: str) -> str:
    """`; did you mean ...?` for an unknown key: another framework's name for a kv4rl key, a close name in its
    section, or the same name one section down (`lr=...` for `trainer.lr=...`, `engine.kv_format` for
    `engine.kv.format`); empty when there is none."""
    dotted = lambda n: f"{prefix}.{n}" if prefix else n  # noqa: E731
    foreign = other_key_hint(dotted(name))  # its path first (eval.n_samples_per_prompt is not rollout.group_size)
    if foreign is not None:
        typo = [c for c in difflib.get_close_matches(name, list(schema), n=1, cutoff=0.85)  # trainer.beta: betas;
                if abs(len(c) - len(name)) <= 2]  # not slime's hf_checkpoint: checkpoint
        return f"; did you mean {dotted(typo[0])}? (or: {foreign})" if typo else f"; {foreign}"
    name = name.lower().replace("-", "_")  # TRAINER.LR, trainer-lr: the keys are lower case, words joined by `_`
    cased = [dotted(name)] if name in schema else []
    nested = [dotted(f"{section}.{name}") for section, tp in schema.items()
              if _is_section(tp) and name in _schema(tp)]
    # a section's key written with `_` for its dot: engine.kv_format for engine.kv.format
    flattened = [dotted(f"{section}.{name.removeprefix(section + '_')}") for section, tp in schema.items()
                 if _is_section(tp) and name.startswith(section + "_") and name.removeprefix(section + "_") in _schema(tp)]
    close = [dotted(n) for n in difflib.get_close_matches(name, list(schema), n=2, cutoff=0.75)]
    found = cased or nested or flattened or close
    return f"; did you mean {' or '.join(found)}?" if found else ""


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build section `cls` from a (possibly partial) mapping; unknown keys are errors, every one of them (and of
    the sections inside) in one ConfigError."""
    schema = _schema(cls)
    kwargs, problems = {}, []
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in schema:
            hint = ("; a key of a loss in your own module needs that module in algo.plugins"
                    if prefix == "algo" else "")
            # a foreign name with a section's value is read leaf by leaf (trainer.optim.max_norm: trainer.grad_clip)
            leaves = (_foreign_keys(key, value, schema, prefix)
                      if name.replace("-", "_") not in OTHER_FRAMEWORKS or isinstance(value, dict) else [])
            named = [(leaf, why) for leaf, why in leaves if why is not None and leaf != key]
            if named:  # a pasted path or section: each key another framework names, then the rest in one line
                problems += [f"unknown config key '{leaf}'; {why}" for leaf, why in named]
                rest = [leaf for leaf, why in leaves if why is None]
                if rest:
                    problems.append(f"unknown config key{'s' if len(rest) > 1 else ''} {', '.join(rest)}: "
                                    f"{NO_COUNTERPART}")
            else:
                near = _did_you_mean(name, schema, prefix)
                paths = [leaf for leaf, _ in leaves if leaf != key]
                if paths and not near and not prefix:  # a pasted top-level path (verl's) none of whose keys has a
                    # counterpart: name each (inside a kv4rl section, its known keys are the better help)
                    problems.append(f"unknown config key{'s' if len(paths) > 1 else ''} {', '.join(paths)}: "
                                    f"{NO_COUNTERPART}")
                else:
                    problems.append(f"unknown config key '{key}'{near} (known here: {', '.join(schema)}){hint}")
            continue
        try:
            kwargs[name] = _coerce(value, schema[name], key)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError.of(problems)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) suitable for YAML."""

    def plain(v: Any) -> Any:
        if hasattr(v, "config_values"):
            return {k: plain(x) for k, x in v.config_values().items()}
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.load(raw, Loader=StrictLoader) if raw.strip() else ""
    except AmbiguousNumber as exc:
        shell = f", on the command line inside the shell's quotes: \"{key}='{raw.strip()}'\"" if "dropping its '_'" in exc.problem else ""
        raise ConfigError(f"{key}: {exc.problem}{shell}") from None
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. a template like `{problem}=`): take it as a plain string
    else:
        comment = _comment_start(raw)
        if comment is not None:  # `data.prompt_template=### Q: {problem}` became null, the default, silently
            raise ConfigError(f"{key}: YAML reads {raw[comment:]!r} as a comment, so the value would be {value!r}; "
                              f"quote the value within the shell's quotes to keep it (\"{key}='...'\")")
    return key.split("."), value


def _comment_start(raw: str) -> int | None:
    """Where a YAML comment starts in `raw` (a `#` outside every token), or None."""
    if "#" not in raw:
        return None
    spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(raw)]
    return next((i for i, ch in enumerate(raw) if ch == "#" and not any(a <= i < b for a, b in spans)), None)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge dotted overrides into a nested dict (structure checked later by from_dict). A key given twice
    takes the last value, as a script that appends overrides to a command expects; the earlier is unused."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # set so by the config file or an earlier override
                raise ConfigError(f"override '{text}': '{'.'.join(path[:depth + 1])}' is already the value "
                                  f"{child!r} (from the config file or an earlier override), not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a YAML file")
    if not path.is_file():
        hint = ""
        if not path.is_absolute() and path.parts[:1] == ("recipes",):
            hint = (" (the recipes are in kv4rl's source tree, not in an installed package: run from the "
                    "repository's root or give the recipe file's path)")
        raise ConfigError(f"config file not found: {path}{hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(exc)}") from exc
    if data is None:
        raise ConfigError(f"config file {path} holds no settings; leave --config out to train with the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `top` over `base` (new dict)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
