"""YAML's safe loader made strict for configs: a value YAML 1.1 would read as another number than it shows, a key
given twice in one mapping, and a key that is not a name are errors with their line and column, not silent
readings (`config_loader` reads config files and override values through it)."""

from __future__ import annotations

import re

import yaml


class AmbiguousNumber(yaml.constructor.ConstructorError):
    """A YAML 1.1 integer that means another number than it shows (`010` is 8, `1:40` is 100)."""


_DECIMAL_OR_HEX = re.compile(r"[-+]?(0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)")


class StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently,
    so one of the two settings the user wrote would be ignored) and the YAML 1.1 integers that silently
    mean another number: a leading zero is octal (`iterations: 010` was 8), `1:40` is base 60 (100), and an
    underscore is dropped (`0.5_2` is 0.52, `1_2` is 12) unless it groups an integer's digits by thousands (`10_000`)."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if not _DECIMAL_OR_HEX.fullmatch(text):
            raise AmbiguousNumber(None, None, f"{text!r} is read by YAML as {super().construct_yaml_int(node)}, "
                                  f"not as written; write the number without a leading zero or ':' (or quote it "
                                  f"for text)", node.start_mark)
        if "_" in text and not _GROUPED_INT.fullmatch(text.lstrip("+-")):  # `1_2` (the bounds 1 and 2) became 12
            raise AmbiguousNumber(None, None, _underscore_problem(text, super().construct_yaml_int(node)),
                                  node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        if "_" in text:  # `0.5_2.0`-style bounds written `0.5_2` became the number 0.52
            raise AmbiguousNumber(None, None, _underscore_problem(text, super().construct_yaml_float(node)),
                                  node.start_mark)
        return super().construct_yaml_float(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        merges = [key_node for key_node, _ in node.value if key_node.tag == "tag:yaml.org,2002:merge"]
        if len(merges) > 1:  # the later silently took over the earlier's keys; `<<: [*a, *b]` says which wins
            raise yaml.constructor.ConstructorError(
                None, None, "key '<<' is given twice in one mapping (merge several as <<: [*a, *b])",
                merges[1].start_mark)
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: the base's keys, which this one's override
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # `1:`, `true:`, `on:` (YAML 1.1's true), `null:` read as those values
                what = (f"a {type(key).__name__}" if isinstance(key, list | dict)
                        else f"{'null' if key is None else repr(key)} (quote it if it is one)")
                raise yaml.constructor.ConstructorError(None, None, f"a key must be a name, not {what}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
_GROUPED_INT = re.compile(r"[0-9]{1,3}(_[0-9]{3})+")  # 10_000: digits grouped by thousands, read as written


def _underscore_problem(text: str, number) -> str:
    return (f"{text!r} is read by YAML as the number {number}, dropping its '_'; write the number without it, or "
            f"quote it for text ('{text}')")


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (YAML's own text spans several, with a caret)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
