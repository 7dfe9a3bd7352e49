"""K3's chat format (XTML), as the checkpoint's tokenizer carries it: four special tokens and a chat template.

A message is `<|open|>message role="ROLE"<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`; an assistant body holds a
`think` channel, a `response` channel and, when it calls tools, a `tools` channel of `call` blocks whose
`argument key=".." type=".."` blocks carry string values raw and every other type as JSON; attribute values escape
`&` and `"` as `&amp;` and `&quot;`. An assistant message in the history keeps its `think` channel when it has
`reasoning_content` (or `reasoning`, vLLM's name: a tool loop sends it back), so a turn rendered into the history is the generation prompt plus
what the model wrote, with thinking on or off. Declared tools come first in a `tool-declare` system message (compact JSON,
sorted keys), then, when thinking is on (the default; `thinking=False` or `enable_thinking=False` in the template
kwargs turns it off), a `thinking-effort` system message. The generation prompt opens the assistant message and its
first channel (`think`, or `response` without thinking). This is the form vLLM's `kimi_k3` tool-call and reasoning
parsers read back; the template is rendered by the tokenizer (`apply_chat_template`), on the server and here alike.
"""

from __future__ import annotations

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
CHAT_TOKENS = [OPEN, CLOSE, SEP, END_OF_MSG]

_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
_THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                    "Now the system is invoked with `thinking_effort=")


def _message_open(role: str, attrs: str = "") -> str:
    return f'{OPEN}message role="{role}"{attrs}{SEP}'


_MESSAGE_CLOSE = f"{CLOSE}message{SEP}{END_OF_MSG}"

# One line of Jinja per piece; `{%- -%}` everywhere, so the tokenizer's trim/lstrip settings change nothing.
CHAT_TEMPLATE = "".join([
    "{%- macro esc(v) -%}{{ v | string | replace('&', '&amp;') | replace('\"', '&quot;') }}{%- endmacro -%}",
    "{%- macro body(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}"
    "{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}",
    "{%- macro xtype(v) -%}{%- if v is boolean -%}boolean{%- elif v is none -%}null{%- elif v is number -%}number"
    "{%- elif v is string -%}string{%- elif v is mapping -%}object{%- else -%}array{%- endif -%}{%- endmacro -%}",
    "{%- if thinking is defined -%}{%- set think = thinking -%}{%- elif enable_thinking is defined -%}"
    "{%- set think = enable_thinking -%}{%- else -%}{%- set think = true -%}{%- endif -%}",
    "{%- if tools -%}", _message_open("system", ' type="tool-declare"'), _TOOL_DECLARE,
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}\n```", _MESSAGE_CLOSE, "{%- endif -%}",
    "{%- if think -%}", _message_open("system", ' type="thinking-effort"'), _THINKING_EFFORT,
    "{{ thinking_effort | default('max') }}`.", _MESSAGE_CLOSE, "{%- endif -%}",
    "{%- for m in messages -%}",
    f'{OPEN}message role="{{{{ esc(m.role) }}}}"',
    "{%- if m.role == 'tool' and m.name %} name=\"{{ esc(m.name) }}\"{%- endif -%}", SEP,
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
    _MESSAGE_CLOSE,
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}", _message_open("assistant"),
    f"{{%- if think -%}}{OPEN}think{SEP}{{%- else -%}}{OPEN}response{SEP}{{%- endif -%}}",
    "{%- endif -%}",
])
