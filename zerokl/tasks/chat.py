"""Agent turns in K3's chat format, token in / token out.

A chat task (`chat = True`; optional `tools`, OpenAI function schemas, `system` and `thinking`) has its prompt
rendered by the checkpoint's chat template (a system message, the problem's text as the user message, the tools
declared). A turn ends at `<|end_of_msg|>`; its text, special tokens kept, is parsed by vLLM's own `kimi_k3`
reasoning and tool-call parsers into a `ChatAction`, which is what the episode's `step` receives. The environment's
answer is appended as the ids of the messages the chat template renders for it: one `tool` message per call of the
turn, in order, named after its tool and carrying the call's id, when the turn called tools (a call whose arguments
are not a JSON object is answered with that error: `zerokl.tasks.agent.answer_tools`), a `user` message otherwise,
then the next generation prompt; whatever the policy left open of its own message is closed first. Nothing the policy
sampled is rendered or tokenised again.
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
    """One call of a turn's tools channel: the tool's `name`, its `arguments`, its `id` (the call's 1-based index in
    the turn, as the tools channel numbers it: deterministic, so a trajectory's tokens depend on nothing else) and,
    when its arguments are not a JSON object, `error` saying so (arguments then {})."""

    name: str
    arguments: dict[str, Any]
    id: str = "1"
    error: str | None = None


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

    def _call(self, name: str, raw: str, call_id: str) -> ToolCall:
        """A parsed call with its arguments and, when they are malformed (not a JSON object, or not what the declared
        tool takes: `argument_error`), the error the policy is told."""
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, call_id, f"malformed arguments ({e.msg} at character {e.pos})")
        if not isinstance(value, dict):
            return ToolCall(name, {}, call_id,
                            f"malformed arguments (a JSON object is expected, got {type(value).__name__})")
        declared = {t.get("function", {}).get("name"): t for t in self.tools or ()}
        return ToolCall(name, value, call_id, argument_error(declared.get(name), value))

    def action(self, ids: list[int]) -> ChatAction:
        """The turn the policy sampled (`ids`, up to and with its stop or end-of-sequence token), parsed."""
        ends = {*self.stop_token_ids, self.tokenizer.eos_token_id}
        text = self.tokenizer.decode([t for t in ids if t not in ends], skip_special_tokens=False)
        reasoning, rest = (self._reasoning.extract_reasoning(text, self._request) if self.thinking else (None, text))
        parsed = self._tool_parser(self.tokenizer).extract_tool_calls(rest or "", self._request)
        calls = tuple(self._call(c.function.name, c.function.arguments, str(i))
                      for i, c in enumerate(parsed.tool_calls, start=1))
        return ChatAction(text, parsed.content or "", reasoning, calls)

    def observation(self, ids: list[int], action: ChatAction, answer: str | tuple[str, ...]) -> list[int]:
        """The ids that follow the turn `ids`: the end of the policy's message where it left it open, the
        environment's answer as one tool message per call of the turn, in order, each with its call's id (`answer`:
        a tuple of one answer per call), or as a user message (a turn without calls), then the next generation
        prompt."""
        if action.tool_calls:
            answers = (answer,) if isinstance(answer, str) else answer
            if len(answers) != len(action.tool_calls):
                raise ValueError(f"the environment answered {len(answers)} of the turn's {len(action.tool_calls)} "
                                 "tool calls; answer each, in order (zerokl.tasks.agent.answer_tools)")
            messages = [{"role": "tool", "name": c.name, "tool_call_id": c.id, "content": a}
                        for c, a in zip(action.tool_calls, answers)]
        else:
            messages = [{"role": "user", "content": answer if isinstance(answer, str) else "".join(answer)}]
        text = self._render(messages, generation=True)
        text = text[text.index(f'{OPEN}message role="{messages[0]["role"]}"'):]  # after the system preamble
        closed = bool(ids) and ids[-1] in self.stop_token_ids and self.tokenizer.decode(
            ids[:-1], skip_special_tokens=False).endswith(MESSAGE_CLOSE)
        return self._ids(text if closed else MESSAGE_CLOSE + END_OF_MSG + text)


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "number": (int, float), "integer": (int,),
                                            "boolean": (bool,), "object": (dict,), "array": (list,), "null": (type(None),)}


def argument_error(tool: dict[str, Any] | None, arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the declared `tool` (an OpenAI function schema; None: no such tool is declared):
    a required argument missing, or one whose value is not of its declared JSON type (vLLM's kimi_k3 parser keeps
    the raw text of a typed argument that does not decode). None when they fit."""
    if tool is None:
        return "no such tool is declared"
    schema = tool.get("function", {}).get("parameters") or {}
    properties = schema.get("properties") or {}
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"malformed arguments (missing required argument {missing[0]!r})"
    for key, value in arguments.items():
        kind = (properties.get(key) or {}).get("type")
        types = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if types is not None and (not isinstance(value, types) or (kind in ("number", "integer")
                                                                   and isinstance(value, bool))):
            return f"malformed arguments ({key!r} must be a JSON {kind}, got {json.dumps(value)})"
    return None
