"""Problem -> prompt token ids, with the tokenizer's chat template when asked for.

Templates and prompt lengths are checked before any generation: a template without `{problem}`
makes every prompt the same text, and a prompt that fills the model's context would only fail deep
inside the model (a position index out of range) after minutes of work.
"""

from __future__ import annotations

import logging
import string
import unicodedata

from kv4rl.data.types import Problem
from kv4rl.paths import text_problem

log = logging.getLogger(__name__)

SNIPPET_CHARS = 60  # how much of an offending problem an error message quotes
LENGTHS_BATCH = 1024  # prompts tokenized per call by `PromptFormatter.lengths`
LENGTHS_SAID = 20_000  # from this many prompts on, measuring them is said in the log


def check_template(template: str, option: str) -> None:
    """Raise ValueError, naming `option`, unless `template` formats with exactly one field, `{problem}`."""
    problem = text_problem(option, template, path=False)
    if problem is not None:  # the tokenizer's raw TypeError came out of the first prompt, a traceback
        raise ValueError(problem)
    control = next((c for c in template if unicodedata.category(c) == "Cc" and c not in "\n\t\r"), None)
    if control is not None:  # YAML's double quotes read `\b` in "\boxed{{}}" as a backspace: train and eval differed
        raise ValueError(f"{option}: {template!r} holds the control character {control!r}; in YAML's double quotes "
                         f"a backslash starts an escape (\\b is a backspace): quote the template with single quotes")
    try:
        parsed = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
        fields = {name for name, _, _ in parsed}
    except ValueError as exc:
        raise ValueError(f"{option}: {template!r} is not a template ({exc}); write a literal brace as "
                         "{{ or }}") from None
    if "problem" not in fields:
        raise ValueError(f"{option}: {template!r} has no {{problem}} field, so every prompt would be the "
                         "same text")
    others = sorted(fields - {"problem"})
    if others:
        shown = ", ".join("{" + name + "}" for name in others)
        raise ValueError(f"{option}: {template!r} has fields other than {{problem}} ({shown}); write a "
                         "literal brace as {{ or }}, e.g. \\boxed{{}}")
    try:  # `{problem:d}` or `{problem!x}` parse, but do not format a problem's text
        template.format(problem="x")
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"{option}: {template!r} does not format a problem ({exc}); write the field as "
                         "plain {problem}") from None
    altered = [f"{{problem{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
               for _, spec, conversion in parsed if spec or conversion]
    if altered:  # `{problem:.10}` cut every problem at 10 characters, `{problem!r}` quoted it and escaped its lines
        raise ValueError(f"{option}: {template!r} changes the problem's text with {altered[0]}; write the field "
                         "as plain {problem}")


BOXED_GRADERS = ("math_verify", "exact")  # the rewards that grade a response's last \\boxed{...} and nothing else
PROMPTS_SAMPLED = 64  # how many prompts the boxed-request check reads


def boxed_request_note(problems: list[Problem], formatter: PromptFormatter, verifier: str, *,
                       eval_cli: bool = False) -> str | None:
    """A line to say where `verifier` grades only a boxed answer and none of the first prompts asks for one: every
    answer would score 0 (verl's GSM8K prompts ask for '#### <answer>'). The template option is train's key, or
    `kv4rl eval`'s where `eval_cli`."""
    sampled = problems[:PROMPTS_SAMPLED]
    if verifier not in BOXED_GRADERS or not sampled or any("boxed" in formatter.text(p) for p in sampled):
        return None
    asked = "'{problem} Put the final answer within \\boxed{{}}.'"
    option, example = (("--template", f"--template {asked}") if eval_cli else
                       ("data.prompt_template", f"\"data.prompt_template={asked}\""))
    return (f"reward {verifier} grades a response's last \\boxed{{...}} only, and none of the first {len(sampled)} "
            f"prompts asks for one, so an answer written otherwise scores 0: ask for it in {option}, e.g. {example}")


class PromptFormatter:
    def __init__(self, tokenizer, template: str, chat: bool = False):
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat template was asked for (--chat or data.chat_template) but the "
                             "tokenizer has none")
        self.tokenizer = tokenizer
        self.template = template
        self.chat = chat
        self._lengths: dict[tuple[str, bool, str], int] = {}  # prompt token counts by (template, chat, problem)

    def text(self, problem: Problem) -> str:
        return self._text(problem.problem)

    def _text(self, problem: str) -> str:
        body = self.template.format(problem=problem)
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        return body

    def ids(self, problem: Problem) -> list[int]:
        text = self.text(problem)
        # chat templates already contain any BOS; plain prompts get the tokenizer's own specials
        return self.tokenizer.encode(text, add_special_tokens=not self.chat)

    def lengths(self, problems: list[Problem]) -> list[int]:
        """Each problem's prompt length in tokens (`len(ids(problem))`), tokenized in batches and kept: a start-up
        measures a 100k-row file twice (the row limit, the context), one row at a time 73 s each pass."""
        known = self._lengths
        todo = list(dict.fromkeys(p.problem for p in problems if (self.template, self.chat, p.problem) not in known))
        if len(todo) >= LENGTHS_SAID:
            log.info("measuring the prompts of %d problems in tokens", len(todo))
        for start in range(0, len(todo), LENGTHS_BATCH):
            texts = todo[start:start + LENGTHS_BATCH]
            ids = self.tokenizer([self._text(text) for text in texts],
                                 add_special_tokens=not self.chat)["input_ids"]
            known.update(((self.template, self.chat, text), len(row)) for text, row in zip(texts, ids))
        return [known[self.template, self.chat, p.problem] for p in problems]


def check_prompt_lengths(problems: list[Problem], lengths: list[int], limit: int, limit_name: str,
                         what: str) -> None:
    """Refuse prompts that leave no room for a response within `limit` positions.

    `lengths[i]` is the token length of problem `i`'s prompt, `what` names the problem set (e.g.
    "--data") and `limit_name` where the limit comes from (e.g. "the model's context"). The message
    names the first offending problem by index, id and opening text, and counts the others, so the
    user can filter the file or pick a model with a longer context.
    """
    too_long = [i for i, length in enumerate(lengths) if length >= limit]
    if not too_long:
        return
    first = too_long[0]
    problem = problems[first]
    text = " ".join(problem.problem.split())
    snippet = text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "…"
    raise ValueError(
        f"{what}: prompt {first} (id {problem.id}: {snippet!r}) is {lengths[first]} tokens, but {limit_name} is "
        f"{limit} positions, which leaves no room for a response; {len(too_long)} of {len(problems)} prompts "
        "are that long (use a model with a longer context, or shorter problems)"
    )


def longest_prompt(formatter: PromptFormatter, problems: list[Problem], limit: int, limit_name: str,
                   what: str) -> int:
    """Token length of the longest prompt of `problems`, after refusing any that fills `limit`
    (`check_prompt_lengths`)."""
    lengths = formatter.lengths(problems)
    check_prompt_lengths(problems, lengths, limit, limit_name, what)
    return max(lengths)


def overrun_warning(longest: int, max_new_tokens: int, setting: str, limit: int, limit_name: str) -> str | None:
    """The one-line warning for a response limit that runs past `limit` (None when it fits): such
    responses stop at the limit, as inference engines clamp them, instead of failing. `setting` names
    the limit as the user gave it (e.g. "--max-new-tokens 100")."""
    if longest + max_new_tokens <= limit:
        return None
    return (f"the longest prompt ({longest} tokens) + {setting} exceed {limit_name} of {limit} "
            f"positions; responses stop when prompt + response reach {limit} tokens")
