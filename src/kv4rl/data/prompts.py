"""Problem -> prompt token ids, with the tokenizer's chat template when asked for."""

from __future__ import annotations

from kv4rl.data.types import Problem


class PromptFormatter:
    def __init__(self, tokenizer, template: str, chat: bool = False):
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.chat_template is true but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.template = template
        self.chat = chat

    def text(self, problem: Problem) -> str:
        body = self.template.format(problem=problem.problem)
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        return body

    def ids(self, problem: Problem) -> list[int]:
        text = self.text(problem)
        # chat templates already contain any BOS; plain prompts get the tokenizer's own specials
        return self.tokenizer.encode(text, add_special_tokens=not self.chat)
