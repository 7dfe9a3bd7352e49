"""Multi-turn PPO (`configs/ppo-tiny-agent.yaml`: guess-the-number on k3-tiny-mxfp4) and the episode runner it uses
(`zerokl.ppo.episodes`): token in / token out trajectories, environment tokens masked, every later turn served from
the prefix cache, the zero-KL check over the policy tokens of every turn, a bitwise resume; environments that raise,
hang or answer nonsense end their trajectory, never the run."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import assert_resumes_bitwise, assert_zero_kl_step
from parity.config import ConfigError
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.episodes import Limits, TextDialogue, run_episodes
from zerokl.ppo.loop import PPORun
from zerokl.tasks import Problem, make_task
from zerokl.tasks.agent import GuessEpisode, Turn
from zerokl.tasks.calculator import CalculatorError, calculate

REPO = Path(__file__).resolve().parents[2]


def _fake_generate(prompts: list[list[int]], n: int, max_tokens: int, record: bool, seed: list[int],
                   **_: object) -> list[SimpleNamespace]:
    """Each request answers the tokens [7, 8] with log-probs -1, -2 (and no routing)."""
    assert n == 1 and record and len(seed) == len(prompts) == len(set(seed))
    return [SimpleNamespace(prompt_ids=p, completion_ids=[7, 8], logprobs=torch.tensor([-1.0, -2.0]),
                            raw_logprobs=torch.tensor([-1.5, -2.5]), routing=None, policy_version=0,
                            cached_tokens=len(p) - 3) for p in prompts]


class _Echo:
    def __init__(self, turns: int):
        self.left = turns

    def step(self, action: str) -> Turn:
        self.left -= 1
        return Turn(f"<{action}>", 0.25, self.left == 0)


class _Raises:
    def step(self, action: str) -> Turn:
        raise ValueError("tool failed")


class _Hangs:
    def step(self, action: str) -> Turn:
        time.sleep(30)
        return Turn("", 1.0, True)


class _Nonsense:
    def step(self, action: str) -> object:
        return {"observation": "?"}


def test_episodes_append_ids_mask_the_environment_and_survive_bad_environments() -> None:
    encode = lambda text: [100 + len(text)]  # noqa: E731 (one id per observation)
    decode = lambda ids: "".join(map(str, ids))  # noqa: E731
    limits = Limits(max_turns=3, max_tokens=2, max_length=64, step_timeout_s=0.5)
    runs = run_episodes(_fake_generate, TextDialogue(encode, decode), [[1, 2, 3]] * 5,
                        [_Echo(2), _Echo(9), _Raises(), _Hangs(), _Nonsense()], limits, seed=0)
    done, capped, raised, hung, nonsense = runs
    # token in / token out: the prompt, then per turn the sampled ids and the observation's ids, never re-tokenised
    assert done.ids == [1, 2, 3, 7, 8, 104, 7, 8] and done.end == "done" and done.turns == 2 and done.reward == 0.5
    assert done.policy_mask == [True, True, False, True, True]
    assert done.logprobs[:2] == [-1.0, -2.0] and done.logprobs[2] != done.logprobs[2]  # NaN at the environment's
    assert capped.end == "max_turns" and capped.turns == 3 and len(capped.completion_ids) == 2 * 3 + 2
    assert raised.end == "error: the environment step raised ValueError: tool failed" and raised.turns == 1
    assert hung.end == "error: the environment step took longer than 0.5 s"
    assert nonsense.end == "error: the environment step returned dict, not a Turn"
    short = run_episodes(_fake_generate, TextDialogue(encode, decode), [[1] * 60], [_Echo(9)], limits, seed=0)[0]
    assert short.end == "length" and len(short.ids) == 62  # another turn (1 + 2 tokens) would pass the 64


def test_guess_feedback_and_reward() -> None:
    game = GuessEpisode(secret=6, high=9, max_turns=3)
    assert game.step("3") == Turn(" higher. Guess:", pytest.approx(0.1 + 0.2 * (1 - 3 / 9)), False)
    assert game.step("a word") == Turn(" no number. Guess:", 0.0, False)
    assert game.step(" 6 ") == Turn("", pytest.approx(0.8), True)  # right on the last guess: no bonus left
    assert GuessEpisode(6, 9, 3).step("6").reward == pytest.approx(0.8 + 0.5 * 2 / 3)


@pytest.mark.parametrize(("expression", "value"), [("3*(4+1)", 15), (" -2 ** 3 ", -8), ("7 // 2 + 7 % 2", 4),
                                                  ("1.5 * 4", 6.0), ("2 ** 64", 2**64), ("((1))", 1)])
def test_calculator_computes_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os').system('true')", "Call is not arithmetic"), ("x + 1", "Name is not arithmetic"),
    ("2 ** 65", "exponent above 64"), ("10 ** 40", "result too large"), ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "complex result"), ("'a' * 3", "Constant is not arithmetic"), ("1 +", "not an arithmetic"),
    ("1" * 201, "longer than 200"), ("[1, 2]", "List is not arithmetic")])
def test_calculator_refuses_what_is_not_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


def test_calculator_task_counts_tool_calls_and_errors() -> None:
    task = make_task("calculator", digits=1)
    game = task.episode(task.sample(__import__("random").Random(3)))
    assert game.step("calc 6*7") == Turn(" = 42. Answer:", 0.0, False, tool_call=True)
    assert game.step("calc open('f')") == Turn(" error: Call is not arithmetic. Answer:", 0.0, False, tool_call=True,
                                                tool_error=True)
    assert game.step("42").done


def _env_file(tmp_path: Path, body: str) -> str:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "env.py").write_text("from zerokl.tasks import Problem, Turn\n" + body)
    return str(tmp_path / "env.py")


@pytest.mark.parametrize(("body", "spec", "says"), [
    ("", "{f}", "expected FILE.py:CLASS"),
    ("", "{f}:Missing", "has no class 'Missing'"),
    ("raise ImportError('no module named gym')", "{f}:E", "importing"),
    ("class E:\n    def __init__(self): raise ValueError('needs a key')", "{f}:E", "E() raised ValueError: needs a key"),
    ("class E:\n    def sample(self, rng): return Problem('p', 'a')", "{f}:E", "E has no method episode(...)"),
    ("class E:\n    def sample(self, rng): return 'p'\n    def episode(self, p): return None", "{f}:E",
     "sample returned 'p', not a Problem"),
])
def test_user_environment_files_are_checked_at_load(body: str, spec: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        make_task("env", path=spec.format(f=_env_file(tmp_path, body)))


def test_a_user_environment_that_cannot_make_an_episode_ends_only_its_trajectory(tmp_path: Path) -> None:
    body = ("class E:\n    def sample(self, rng): return Problem('p', str(rng.random()))\n"
            "    def episode(self, p): raise KeyError(p.answer)\n")
    task = make_task("env", path=f"{_env_file(tmp_path, body)}:E")
    runs = run_episodes(_fake_generate, TextDialogue(lambda t: [1], str), [[1, 2, 3]],
                        [task.episode(Problem("p", "x"))], Limits(3, 2, 64, 1.0), seed=0)
    assert runs[0].end == "error: the environment step raised RuntimeError: episode(problem) raised KeyError: 'x'"


def _scripted(turns: list[list[int]]):
    """A `generate` that answers each trajectory's k-th request with `turns[k]` (log-probs -1), checking the stop."""
    calls: list[int] = []

    def generate(prompts: list[list[int]], n: int, max_tokens: int, record: bool, seed: list[int],
                 stop_token_ids: list[int], **_: object) -> list[SimpleNamespace]:
        assert n == 1 and record and stop_token_ids
        calls.append(len(calls))
        ids = turns[len(calls) - 1]
        return [SimpleNamespace(prompt_ids=p, completion_ids=ids, logprobs=-torch.ones(len(ids)), raw_logprobs=None,
                                routing=None, policy_version=0, cached_tokens=0) for p in prompts]
    return generate


CALL = ('Let me compute.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="calculator" index="1"<|sep|>'
        '<|open|>argument key="expression" type="string"<|sep|>3*4+5<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


def test_chat_turns_parse_with_vllms_kimi_k3_parsers_and_the_trajectory_is_the_templates_rendering(
        k3_tiny: Path) -> None:
    """K3's chat format, token in / token out: the policy's tool call (vLLM's kimi_k3 parser) runs the calculator,
    whose result comes back as a tool message; the trajectory's ids are exactly what the chat template renders for the
    whole conversation. A turn cut off by the token limit is closed for it before the environment's message."""
    from zerokl.tasks.calculator import TOOL
    from zerokl.tasks.chat import ChatAction, ChatDialogue, ToolCall

    task = make_task("calculator", chat=True)
    dialogue = ChatDialogue(k3_tiny, task)
    tokenizer = dialogue.tokenizer
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    answer = "17<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    problem = Problem("What is 3 * 4 + 5?", "17")
    run = run_episodes(_scripted([ids(CALL), ids(answer)]), dialogue, [dialogue.prompt_ids(problem.prompt)],
                       [task.episode(problem)], Limits(3, 64, 1024, 5.0), seed=0)[0]
    assert run.end == "done" and run.turns == 2 and run.tool_calls == 1 and run.tool_errors == 0
    assert run.reward == pytest.approx(1.0)
    conversation = [{"role": "system", "content": task.system}, {"role": "user", "content": problem.prompt},
                    {"role": "assistant", "content": "Let me compute.", "tool_calls": [{"type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": "3*4+5"}}}]},
                    {"role": "tool", "name": "calculator", "content": "17"}, {"role": "assistant", "content": "17"}]
    assert run.ids == ids(tokenizer.apply_chat_template(conversation, tools=[TOOL], tokenize=False, thinking=False))
    assert sum(run.policy_mask) == len(ids(CALL)) + len(ids(answer))

    assert dialogue.action(ids(CALL)) == ChatAction(CALL.removesuffix("<|end_of_msg|>"), "Let me compute.", None,
                                                    (ToolCall("calculator", {"expression": "3*4+5"}),))
    guess = make_task("guess", chat=True)
    chat = ChatDialogue(k3_tiny, guess)
    cut = ids(" 5 and")  # no end of message: the token limit cut it
    after = chat.observation(cut, chat.action(cut), "higher. Guess:")
    assert tokenizer.decode(after, skip_special_tokens=False) == (
        '<|close|>message<|sep|><|end_of_msg|><|open|>message role="user"<|sep|>higher. Guess:<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert guess.episode(Problem("p", "5")).step(chat.action(cut)).done  # the response channel's number: right


def test_a_user_chat_environment_declares_its_tools_and_bad_ones_are_refused(k3_tiny: Path, tmp_path: Path) -> None:
    """A user class with `chat = True` runs in K3's chat format with its own tools and system message; malformed tools
    are refused before anything starts, naming the tool."""
    from zerokl.ppo.setup import chat_dialogue

    body = ("class E:\n    chat = True\n    system = 'Be brief.'\n    tools = TOOLS\n"
            "    def sample(self, rng): return Problem('Hi?', 'x')\n    def episode(self, p): return None\n")
    good = "TOOLS = [{'type': 'function', 'function': {'name': 'lookup', 'parameters': {'type': 'object'}}}]\n"
    dialogue = chat_dialogue(k3_tiny, make_task("env", path=f"{_env_file(tmp_path, good + body)}:E"))
    text = dialogue.tokenizer.decode(dialogue.prompt_ids("Hi?"), skip_special_tokens=False)
    assert '"name":"lookup"' in text and "Be brief." in text and text.endswith("<|open|>response<|sep|>")
    bad = "TOOLS = [{'type': 'function', 'function': {'parameters': {}}}]\n"
    with pytest.raises(ConfigError, match=re.escape("task env: tools[0]: expected")):
        chat_dialogue(k3_tiny, make_task("env", path=f"{_env_file(tmp_path / 'bad', bad + body)}:E"))


@pytest.mark.slow  # starts engines and trainers: scheduled first (conftest.py)
def test_multi_turn_ppo_keeps_zero_kl_over_every_turn_and_resumes_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    """Three steps of 8 trajectories (up to 3 guesses each): trajectories of 2+ turns, environment tokens in them, every
    later turn's request served partly from the prefix cache, every policy token of every turn bitwise the trainer's
    one-pass log-prob (processed and raw) with the same experts; a run resumed from the step-2 checkpoint reproduces
    step 2's metrics and the final weights bit for bit."""
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny-agent.yaml"), model=str(k3_tiny_mxfp4), steps=3,
                  prompts_per_step=2, wandb="disabled")
    run = PPORun(cfg, tmp_path / "run", log=lambda _: None)
    try:
        results = []
        for step in range(3):
            results.append(run.run_step())
            if step == 1:
                run.save_state(tmp_path / "step-2")
        final = {n: t.clone() for n, t in run.backend.export_official().items()}
    finally:
        run.close()
    for r in results:
        assert_zero_kl_step(r)
        m = r.metrics
        assert m["turns_mean"] >= 2 and m["env_token_frac"] > 0 and m["later_turn_prefix_hit_frac"] == 1.0, m
        assert m["episode_errors"] == 0, m
    assert_resumes_bitwise(cfg, tmp_path / "resumed", tmp_path / "step-2", results[2].metrics, final)
