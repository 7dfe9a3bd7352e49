"""Agent turns in K3's chat format, token in / token out.

A chat task (`chat = True`; optional `tools`, OpenAI function schemas, `system` and `thinking`) has its prompt
rendered by the checkpoint's chat template (a system message, the problem's text as the user message, the tools
declared). A turn ends at `<|end_of_msg|>`; its text, special tokens kept, is parsed by vLLM's own `kimi_k3`
reasoning and tool-call parsers into a `ChatAction`, which is what the episode's `step` receives. The environment's
answer is appended as the ids of the messages the chat template renders for it: a `tool` message (named after the
first call) when the turn called a tool, a `user` message otherwise, then the next generation prompt; whatever the
policy left open of its own message is closed first. Nothing the policy sampled is rendered or tokenised again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.io.chat_format import (END_OF_MSG, MESSAGE_CLOSE, OPEN, chat_prompt_ids, chat_tokenizer,
                                   check_tools)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ChatAction:
    """One parsed assistant turn: its raw `text` (special tokens kept), the think channel (`reasoning`), the response
    channel (`content`) and the calls of its tools channel, as vLLM's kimi_k3 parsers read them."""

    text: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)


def is_chat_task(task: Any) -> bool:
    return bool(getattr(task, "chat", False))


class ChatDialogue:
    """Renders prompts and environment answers with the checkpoint's chat template and parses the policy's turns;
    `stop_token_ids` end a turn."""

    def __init__(self, checkpoint: str | Path, task: Any):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser
        from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

        self.checkpoint = checkpoint
        self.tools: list[dict] | None = getattr(task, "tools", None) or None
        self.system: str | None = getattr(task, "system", None)
        self.thinking = bool(getattr(task, "thinking", False))
        check_tools(self.tools)  # ChatError, as a tokenizer without the chat format
        self.tokenizer = chat_tokenizer(str(checkpoint))
        kwargs = {"thinking": self.thinking}
        self._request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}],
                                              tools=self.tools, chat_template_kwargs=kwargs)
        self._reasoning = KimiK3ReasoningParser(self.tokenizer, chat_template_kwargs=kwargs)
        self._tool_parser = KimiK3ToolParser  # stateful while streaming: one per turn
        self.stop_token_ids = [self.tokenizer.convert_tokens_to_ids(END_OF_MSG)]

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                                  thinking=self.thinking)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, text: str) -> list[int]:
        """The first generation prompt: the task's system message, then `text` as the user's."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": text}]
        return chat_prompt_ids(self.checkpoint, messages, self.tools, thinking=self.thinking)

    def action(self, ids: list[int]) -> ChatAction:
        """The turn the policy sampled (`ids`, up to and with its stop or end-of-sequence token), parsed."""
        ends = {*self.stop_token_ids, self.tokenizer.eos_token_id}
        text = self.tokenizer.decode([t for t in ids if t not in ends], skip_special_tokens=False)
        reasoning, rest = (self._reasoning.extract_reasoning(text, self._request) if self.thinking else (None, text))
        parsed = self._tool_parser(self.tokenizer).extract_tool_calls(rest or "", self._request)
        calls = tuple(ToolCall(c.function.name, _arguments(c.function.arguments)) for c in parsed.tool_calls)
        return ChatAction(text, parsed.content or "", reasoning, calls)

    def observation(self, ids: list[int], action: ChatAction, answer: str) -> list[int]:
        """The ids that follow the turn `ids`: the end of the policy's message where it left it open, the
        environment's `answer` as a tool message (the turn called a tool) or a user message, the next generation
        prompt."""
        message = ({"role": "tool", "name": action.tool_calls[0].name, "content": answer} if action.tool_calls
                   else {"role": "user", "content": answer})
        text = self._render([message], generation=True)
        text = text[text.index(f'{OPEN}message role="{message["role"]}"'):]  # after the system preamble
        closed = bool(ids) and ids[-1] in self.stop_token_ids and self.tokenizer.decode(
            ids[:-1], skip_special_tokens=False).endswith(MESSAGE_CLOSE)
        return self._ids(text if closed else MESSAGE_CLOSE + END_OF_MSG + text)


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
