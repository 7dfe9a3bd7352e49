"""K3's chat format in our tokenizer: vLLM's own `kimi_k3` reasoning and tool-call parsers read back what the chat
template writes, and an assistant turn rendered into the history is the generation prompt plus that turn's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from parity.io.chat_format import CHAT_TOKENS, END_OF_MSG
from parity.io.tokenizer import build_tokenizer

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic & \"more\"",
                                          "parameters": {"type": "object",
                                                         "properties": {"expression": {"type": "string"}},
                                                         "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"},
                                     "exact": {"type": "boolean"}, "filters": {"type": "object"},
                                     "sites": {"type": "array"}}}}}
CALLS = [
    [{"name": "calculator", "arguments": {"expression": "(2+3)*7 < 40 & \"x\""}}],
    [{"name": "search", "arguments": {"query": "kimi k3", "top_k": 3, "exact": False, "filters": {"lang": "en"},
                                      "sites": ["a.org", "b.org"]}},
     {"name": "calculator", "arguments": {"expression": "1/3"}}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(1024, out)
    return AutoTokenizer.from_pretrained(out)


def test_chat_tokens_are_single_special_ids_inside_the_vocab(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(t) for t in CHAT_TOKENS]
    assert len(set(ids)) == len(CHAT_TOKENS) and all(0 <= i < 1024 for i in ids)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert set(ids) <= set(encoded) and tokenizer.decode(encoded) == text


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("calls", CALLS)
def test_vllm_kimi_k3_parsers_read_back_what_the_template_writes(tokenizer, calls: list[dict], thinking: bool) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser
    from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

    history = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Compute it, please."}]
    turn = {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should call a tool." if thinking
            else None, "tool_calls": [{"id": f"c{k}", "type": "function", "function": c} for k, c in enumerate(calls)]}
    kwargs = {"tools": [CALC, SEARCH], "thinking": thinking}
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template([*history, turn], tokenize=False, **kwargs)
    assert full.startswith(prompt) and full.endswith(END_OF_MSG)
    renamed = {**turn, "reasoning": turn["reasoning_content"], "reasoning_content": None}  # vLLM's name for it
    assert tokenizer.apply_chat_template([*history, renamed], tokenize=False, **kwargs) == full
    output = full[len(prompt):-len(END_OF_MSG)]  # what the model writes after the prompt, up to its stop token

    request = ChatCompletionRequest(model="m", messages=history, tools=[CALC, SEARCH],
                                    chat_template_kwargs={"thinking": thinking})
    reasoning, rest = KimiK3ReasoningParser(tokenizer, chat_template_kwargs={"thinking": thinking}) \
        .extract_reasoning(output, request)
    assert reasoning == (turn["reasoning_content"] if thinking else None)
    parsed = KimiK3ToolParser(tokenizer).extract_tool_calls(rest, request)
    assert parsed.tools_called and parsed.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] \
        == [(c["name"], c["arguments"]) for c in calls]


def test_tool_results_and_names_are_escaped_attributes(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "tool", "name": 'calc"&', "content": "5"}], tokenize=False,
                                         thinking=False)
    assert text == '<|open|>message role="tool" name="calc&quot;&amp;"<|sep|>5<|close|>message<|sep|><|end_of_msg|>'


def test_a_checkpoint_carries_the_chat_template(k3_tiny: Path) -> None:
    config = json.loads((k3_tiny / "tokenizer_config.json").read_text())
    assert "chat_template" in config
    assert AutoTokenizer.from_pretrained(k3_tiny).apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True, thinking=False) \
        == '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>' \
           '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def test_an_image_part_is_the_placeholder_the_model_expands(tokenizer) -> None:
    parts = [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "image_url", "image_url": {"url": "a.png"}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, thinking=False)
    assert text == ('<|open|>message role="user"<|sep|>Look:<|kimi_image_placeholder|><|kimi_image_placeholder|>'
                    '<|close|>message<|sep|><|end_of_msg|>')
