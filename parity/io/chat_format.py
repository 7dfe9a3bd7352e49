"""K3's chat format (XTML), as the checkpoint's tokenizer carries it: four special tokens and a chat template.

A message is `<|open|>message role="ROLE"<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`; an assistant body holds a
`think` channel, a `response` channel and, when it calls tools, a `tools` channel of `call` blocks whose `argument
key=".." type=".."` blocks carry string values raw and every other type as JSON; attribute values escape `&` and `"` as
`&amp;` and `&quot;`. An assistant message in the history keeps its `think` channel when it has `reasoning_content` (or
`reasoning`, vLLM's name: a tool loop sends it back), so a turn rendered into the history is the generation prompt plus
what the model wrote, with thinking on or off. Declared tools come first in a `tool-declare` system message (compact
JSON, sorted keys), then, when thinking is on (the default; `thinking=False` or `enable_thinking=False` in the template
kwargs turns it off), a `thinking-effort` system message. The generation prompt opens the assistant message and its
first channel (`think`, or `response` without thinking). An image content part is the image placeholder token, which
the model's multimodal processor expands (`parity.image`). This is the form vLLM's `kimi_k3` tool-call and reasoning
parsers read back; the template is rendered by the tokenizer (`apply_chat_template`), on the server and here alike.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # an image part: the tokenizer's placeholder, which vLLM expands
CHAT_TOKENS = [OPEN, CLOSE, SEP, END_OF_MSG]

_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
_THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                    "Now the system is invoked with `thinking_effort=")


def _message_open(role: str, attrs: str = "") -> str:
    return f'{OPEN}message role="{role}"{attrs}{SEP}'


MESSAGE_CLOSE = f"{CLOSE}message{SEP}"  # a message's closing tag (END_OF_MSG follows it)
_MESSAGE_END = MESSAGE_CLOSE + END_OF_MSG

# One line of Jinja per piece; `{%- -%}` everywhere, so the tokenizer's trim/lstrip settings change nothing.
CHAT_TEMPLATE = "".join([
    "{%- macro esc(v) -%}{{ v | string | replace('&', '&amp;') | replace('\"', '&quot;') }}{%- endmacro -%}",
    "{%- macro body(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}"
    "{%- if p.type == 'text' -%}{{ p.text }}{%- elif p.type in ('image', 'image_url') -%}", IMAGE_PLACEHOLDER,
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}",
    "{%- macro xtype(v) -%}{%- if v is boolean -%}boolean{%- elif v is none -%}null{%- elif v is number -%}number"
    "{%- elif v is string -%}string{%- elif v is mapping -%}object{%- else -%}array{%- endif -%}{%- endmacro -%}",
    "{%- if thinking is defined -%}{%- set think = thinking -%}{%- elif enable_thinking is defined -%}"
    "{%- set think = enable_thinking -%}{%- else -%}{%- set think = true -%}{%- endif -%}",
    "{%- if tools -%}", _message_open("system", ' type="tool-declare"'), _TOOL_DECLARE,
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}\n```", _MESSAGE_END, "{%- endif -%}",
    "{%- if think -%}", _message_open("system", ' type="thinking-effort"'), _THINKING_EFFORT,
    "{{ thinking_effort | default('max') }}`.", _MESSAGE_END, "{%- endif -%}",
    "{%- for m in messages -%}",
    f'{OPEN}message role="{{{{ esc(m.role) }}}}"',
    "{%- if m.role == 'tool' and m.name %} name=\"{{ esc(m.name) }}\"{%- endif -%}",
    "{%- if m.role == 'tool' and m.tool_call_id %} call=\"{{ esc(m.tool_call_id) }}\"{%- endif -%}", SEP,
    "{%- if m.role == 'assistant' -%}",
    "{%- set r = m.reasoning_content or m.reasoning -%}{%- if r -%}", f"{OPEN}think{SEP}{{{{ r }}}}{CLOSE}think{SEP}",
    "{%- endif -%}",
    f"{OPEN}response{SEP}{{{{ body(m.content) }}}}{CLOSE}response{SEP}",
    "{%- if m.tool_calls -%}", f"{OPEN}tools{SEP}",
    "{%- for call in m.tool_calls -%}{%- set f = call.function if call.function is defined else call -%}",
    f'{OPEN}call tool="{{{{ esc(f.name) }}}}" index="{{{{ loop.index }}}}"{SEP}',
    "{%- if f.arguments is mapping -%}{%- for k, v in f.arguments.items() -%}",
    f'{OPEN}argument key="{{{{ esc(k) }}}}" type="{{{{ xtype(v) }}}}"{SEP}',
    "{%- if v is string -%}{{ v }}{%- else -%}{{ v | tojson }}{%- endif -%}", f"{CLOSE}argument{SEP}",
    "{%- endfor -%}{%- elif f.arguments is defined and f.arguments is not none -%}",
    f'{OPEN}json type="object"{SEP}{{{{ f.arguments }}}}{CLOSE}json{SEP}',
    "{%- endif -%}", f"{CLOSE}call{SEP}", "{%- endfor -%}", f"{CLOSE}tools{SEP}", "{%- endif -%}",
    "{%- else -%}{{ body(m.content) }}{%- endif -%}",
    _MESSAGE_END,
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}", _message_open("assistant"),
    f"{{%- if think -%}}{OPEN}think{SEP}{{%- else -%}}{OPEN}response{SEP}{{%- endif -%}}",
    "{%- endif -%}",
])


class ChatError(ValueError):
    """A chat line that cannot be rendered: what is wrong, in the user's terms."""


ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "reasoning_content", "reasoning", "tool_calls", "tool_call_id"}


def chat_prompt_ids(checkpoint: str | Path, messages: Any, tools: Any = None, thinking: bool = True) -> list[int]:
    """The generation prompt of `messages` (OpenAI chat form) with `tools` declared, thinking on or off, rendered by
    the checkpoint's chat template and tokenised as the server tokenises it; ChatError names the first malformed
    message or tool, or a checkpoint whose tokenizer predates the chat format."""
    _check_messages(messages)
    check_tools(tools)
    tokenizer = chat_tokenizer(str(checkpoint))
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                                         thinking=thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=4)
def chat_tokenizer(checkpoint: str) -> Any:
    """The checkpoint's tokenizer (`tokenizer.json`, `tokenizer_config.json`: zerokl writes a fast tokenizer) with its
    chat template; ChatError when it predates K3's chat format."""
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    except (OSError, ValueError) as e:
        raise ChatError(f"cannot read the tokenizer of {checkpoint}: {e}") from None
    if not tokenizer.chat_template or any(tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)
                                          for t in CHAT_TOKENS):
        raise ChatError(f"the tokenizer of {checkpoint} has no K3 chat format (no chat template or no "
                        f"{', '.join(CHAT_TOKENS)}); write the checkpoint again with zerokl init-checkpoint")
    return tokenizer


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'messages' must be a non-empty list of messages, got {messages!r}")
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(f"{where}: expected an object with 'role' one of {', '.join(ROLES)}, got {m!r}")
        unknown = sorted(set(m) - _MESSAGE_KEYS)
        if unknown:
            raise ChatError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
        content = m.get("content")
        parts_ok = isinstance(content, list) and all(_is_text_part(p) or _image_url(p) for p in content)
        if not (isinstance(content, str) or parts_ok or (content is None and m.get("tool_calls"))):
            raise ChatError(f"{where}: 'content' must be text or a list of {{\"type\": \"text\", \"text\": ...}} "
                            f"and {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}} parts, got {content!r}")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise ChatError(f"{where}: 'tool_calls' is a list, on assistant messages only")
            for j, call in enumerate(calls):
                f = call.get("function") if isinstance(call, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                        or not isinstance(f.get("arguments", {}), (dict, str)):
                    raise ChatError(f"{where}.tool_calls[{j}]: expected {{\"function\": {{\"name\": ..., "
                                    f"\"arguments\": {{...}}}}}}, got {call!r}")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _image_url(part: Any) -> str | None:
    """The URL of an OpenAI image content part (`{"type": "image_url", "image_url": {"url": ...}}`), else None."""
    if not isinstance(part, dict) or part.get("type") != "image_url" or not isinstance(part.get("image_url"), dict):
        return None
    url = part["image_url"].get("url")
    return url if isinstance(url, str) and url else None


def chat_images(messages: list[dict]) -> list[str]:
    """The URLs of the image parts of (checked) `messages`, in the order the template places them."""
    return [url for m in messages if isinstance(m.get("content"), list)
            for url in map(_image_url, m["content"]) if url is not None]


def check_tools(tools: Any) -> None:
    """ChatError naming the first tool that is not an OpenAI function tool with a name and a JSON-schema object."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ChatError(f"'tools' must be a list of tools, got {tools!r}")
    for k, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(f.get("parameters", {}), dict):
            raise ChatError(f"tools[{k}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{JSON schema}}}}}}, got {t!r}")
