"""Multi-turn PPO (`configs/ppo-tiny-agent.yaml`: guess-the-number on k3-tiny-mxfp4) and the episode runner it uses
(`zerokl.ppo.episodes`): token in / token out trajectories, environment tokens masked, every later turn served from
the prefix cache, the zero-KL check over the policy tokens of every turn, a bitwise resume; environments that raise,
hang or answer nonsense end their trajectory, never the run."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers import assert_resumes_bitwise, assert_zero_kl_step
from parity.config import ConfigError
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.environments import Environment, Recipe
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


# Test environments as a user writes them (`task: env`): each class is a task whose episode misbehaves its own way.
ENVIRONMENTS = """
import time


class Echo:  # the problem's answer: how many turns the episode lasts
    def sample(self, rng): return Problem("p", "2")
    def episode(self, problem): return EchoEpisode(int(problem.answer))


class EchoEpisode:
    def __init__(self, turns): self.left = turns
    def step(self, action):
        self.left -= 1
        return Turn(f"<{action}>", 0.25, self.left == 0)


class Raises(Echo):
    def episode(self, problem): return RaisesEpisode()


class RaisesEpisode:
    def step(self, action): raise ValueError("tool failed")


class Hangs(Echo):
    def episode(self, problem): return HangsEpisode()


class HangsEpisode:
    def step(self, action):
        time.sleep(600)
        return Turn("", 1.0, True)


class Nonsense(Echo):
    def episode(self, problem): return NonsenseEpisode()


class SlowStart(Echo):  # making the episode takes longer than a step may
    def episode(self, problem):
        time.sleep(1.5)
        return EchoEpisode(1)


class NonsenseEpisode:
    def step(self, action): return {"observation": "?"}
"""


@pytest.fixture(scope="module")
def environments(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Environment]:
    """A child-process environment of one of `ENVIRONMENTS`'s classes for the problem with that answer."""
    path = _env_file(tmp_path_factory.mktemp("envs"), ENVIRONMENTS)
    return lambda cls, answer="2": Environment(Recipe("env", Problem("p", answer), {"path": f"{path}:{cls}"}))


def _environment_processes() -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name == "zerokl-environment"]


def test_episodes_append_ids_mask_the_environment_and_survive_bad_environments(environments: Any) -> None:
    encode = lambda text: [100 + len(text)]  # noqa: E731 (one id per observation)
    decode = lambda ids: "".join(map(str, ids))  # noqa: E731
    limits = Limits(max_turns=3, max_tokens=2, max_length=64, step_timeout_s=0.5)
    envs = [environments("Echo", "2"), environments("Echo", "9"), environments("Raises"), environments("Hangs"),
            environments("Nonsense")]
    runs = run_episodes(_fake_generate, TextDialogue(encode, decode), [[1, 2, 3]] * 5, envs, limits, seed=0)
    for env in envs:
        env.close()
    done, capped, raised, hung, nonsense = runs
    # token in / token out: the prompt, then per turn the sampled ids and the observation's ids, never re-tokenised
    assert done.ids == [1, 2, 3, 7, 8, 104, 7, 8] and done.end == "done" and done.turns == 2 and done.reward == 0.5
    assert done.policy_mask == [True, True, False, True, True]
    assert done.logprobs[:2] == [-1.0, -2.0] and done.logprobs[2] != done.logprobs[2]  # NaN at the environment's
    assert capped.end == "max_turns" and capped.turns == 3 and len(capped.completion_ids) == 2 * 3 + 2
    assert raised.end == "error: the environment step raised ValueError: tool failed" and raised.turns == 1
    assert hung.end == "error: the environment step took longer than 0.5 s"
    assert nonsense.end == "error: the environment step returned dict, not a Turn"
    env = environments("Echo", "9")
    short = run_episodes(_fake_generate, TextDialogue(encode, decode), [[1] * 60], [env], limits, seed=0)[0]
    env.close()
    assert short.end == "length" and len(short.ids) == 62  # another turn (1 + 2 tokens) would pass the 64


def test_a_hanging_environment_leaves_nothing_running(environments: Any) -> None:
    """The step that overruns its time limit ends the environment's process at once: no process, no thread of it is
    left to keep computing or to write into a later trajectory."""
    threads = set(threading.enumerate())
    hung = environments("Hangs")
    assert len(_environment_processes()) == 1
    t0 = time.monotonic()
    assert hung.step("a guess", 0.5) == "the environment step took longer than 0.5 s"
    assert time.monotonic() - t0 < 10 and _environment_processes() == []
    assert set(threading.enumerate()) <= threads
    hung.close()  # idempotent


def test_a_step_time_limit_counts_the_step_alone(environments: Any) -> None:
    """An environment whose process starts and makes its episode slower than a step may take (as on a loaded
    machine) still answers its first step: the limit starts when the action is sent."""
    slow = environments("SlowStart")
    assert slow.step("a guess", 0.5) == Turn("<a guess>", 0.25, True)
    slow.close()


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
    assert game.step("calc 6*7") == Turn(" = 42. Answer:", 0.0, False, tool_calls=1)
    assert game.step("calc open('f')") == Turn(" error: Call is not arithmetic. Answer:", 0.0, False, tool_calls=1,
                                                tool_errors=1)
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
    env = Environment(Recipe("env", Problem("p", "x"), {"path": f"{_env_file(tmp_path, body)}:E"}))
    runs = run_episodes(_fake_generate, TextDialogue(lambda t: [1], str), [[1, 2, 3]], [env], Limits(3, 2, 64, 1.0),
                        seed=0)
    env.close()
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
    env = Environment(Recipe("calculator", problem, {"chat": True}))
    run = run_episodes(_scripted([ids(CALL), ids(answer)]), dialogue, [dialogue.prompt_ids(problem.prompt)],
                       [env], Limits(3, 64, 1024, 5.0), seed=0)[0]
    env.close()
    assert run.end == "done" and run.turns == 2 and run.tool_calls == 1 and run.tool_errors == 0
    assert run.reward == pytest.approx(1.0)
    conversation = [{"role": "system", "content": task.system}, {"role": "user", "content": problem.prompt},
                    {"role": "assistant", "content": "Let me compute.", "tool_calls": [{"type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": "3*4+5"}}}]},
                    {"role": "tool", "name": "calculator", "tool_call_id": "1", "content": "17"},
                    {"role": "assistant", "content": "17"}]
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


THREE_CALLS = ('<|close|>response<|sep|><|open|>tools<|sep|>'
               '<|open|>call tool="calculator" index="1"<|sep|><|open|>argument key="expression" type="string"<|sep|>'
               '2+3<|close|>argument<|sep|><|close|>call<|sep|>'
               '<|open|>call tool="calculator" index="2"<|sep|><|close|>call<|sep|>'
               '<|open|>call tool="search" index="3"<|sep|><|open|>argument key="q" type="string"<|sep|>x'
               '<|close|>argument<|sep|><|close|>call<|sep|>'
               '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


def test_every_tool_call_of_a_turn_is_answered_in_order_and_malformed_ones_are_tool_errors(k3_tiny: Path) -> None:
    """Three calls in one turn: each gets its own tool message, in the calls' order, carrying its call's id; a call
    missing its required argument and a call of a tool nobody declared are answered with their errors (tool errors
    the policy sees, counted), never dropped or run with made-up arguments."""
    from zerokl.tasks.chat import ChatDialogue

    task = make_task("calculator", chat=True)
    dialogue = ChatDialogue(k3_tiny, task)
    ids = dialogue.tokenizer(THREE_CALLS, add_special_tokens=False)["input_ids"]
    action = dialogue.action(ids)
    assert [(c.name, c.id, c.error) for c in action.tool_calls] == [
        ("calculator", "1", None), ("calculator", "2", "malformed arguments (missing required argument 'expression')"),
        ("search", "3", "no such tool is declared")]
    env = Environment(Recipe("calculator", Problem("What is 1 * 2 + 3?", "5"), {"chat": True}))
    turn = env.step(action, 5.0)
    env.close()
    assert turn == Turn(("5", "error: malformed arguments (missing required argument 'expression')",
                         "error: no such tool is declared"), 0.0, False, tool_calls=3, tool_errors=2)
    text = dialogue.tokenizer.decode(dialogue.observation(ids, action, turn.observation), skip_special_tokens=False)
    assert text == ''.join(f'<|open|>message role="tool" name="{name}" call="{i}"<|sep|>{body}<|close|>message<|sep|>'
                           '<|end_of_msg|>' for i, (name, body) in enumerate(zip(
                               ("calculator", "calculator", "search"), turn.observation), start=1)) + \
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    with pytest.raises(ValueError, match="answered 1 of the turn's 3 tool calls"):
        dialogue.observation(ids, action, "5")


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
