"""`task: jsonl`: user datasets and reward functions, at unit level (no engine, no trainer).

Every bad dataset line, reward spec and reward result is refused with the file, the line and the reason (at config
load, or mid-run as RewardError); the builtin math reward's number extraction; sampling drawn only from the run's
Random (a restored Random continues identically); task_args checked per task; the command exits 2 with one error line
and starts nothing.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from parity.config import ConfigError
from zerokl.cli import main
from zerokl.ppo.config import load_ppo_config
from zerokl.tasks import RewardError, make_task, word_problems
from zerokl.tasks.rewards import last_number, math_reward

REPO = Path(__file__).resolve().parents[2]
GOOD = '{"prompt": "Tom has 3 pens and gets 4 more. How many pens now? Answer:", "answer": 7}'

REWARDS = '''
import math


def score(completion, sample):
    return 1.0 if completion.strip() == str(sample["answer"]) else 0.0


def boom(completion, sample):
    raise ValueError(f"cannot score {sample['answer']}")


def nan(completion, sample):
    return math.nan


def inf(completion, sample):
    return -math.inf


def text(completion, sample):
    return "1.0"


def nothing(completion, sample):
    pass


def mutate(completion, sample):
    sample["answer"] = "changed"
    return 0.0


def one_arg(completion):
    return 0.0


threshold = 0.5
'''


def _dataset(tmp_path: Path, *lines: str | bytes) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return path


def _rewards(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _refused(match: str, **args: object) -> str:
    with pytest.raises(ConfigError) as e:
        make_task("jsonl", **args)
    assert match in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize(("line", "reason"), [
    ('{"answer": 7}', "no 'prompt' field"),
    ('{"prompt": "What is 3 + 4? Answer:"}', "no 'answer' field"),
    ('{"prompt": "What is', "not JSON"),
    ("[1, 2]", "got a JSON list; each line is an object with 'prompt' (text) and 'answer'"),
    ('"just text"', "got a JSON str"),
    ('{"prompt": "  ", "answer": 7}', "'prompt' must be non-empty text, got '  '"),
    ('{"prompt": 5, "answer": 7}', "'prompt' must be non-empty text, got 5"),
    ('{"prompt": "hi", "answer": null}', "'answer' must be text or a finite number, got None"),
    ('{"prompt": "hi", "answer": true}', "'answer' must be text or a finite number, got True"),
    ('{"prompt": "hi", "answer": NaN}', "'answer' must be text or a finite number, got nan"),
    ('{"prompt": "hi", "answer": [7]}', "'answer' must be text or a finite number, got [7]"),
    (b'{"prompt": "caf\xe9", "answer": 7}', "not UTF-8"),
])
def test_bad_dataset_lines_name_file_line_and_reason(line: str | bytes, reason: str, tmp_path: Path) -> None:
    data = _dataset(tmp_path, GOOD, "", line)  # the blank line is skipped but counted
    _refused(f"{data}:3: ", path=str(data), reward="builtin:math")
    _refused(reason, path=str(data), reward="builtin:math")


def test_builtin_math_refuses_an_answer_without_a_number(tmp_path: Path) -> None:
    data = _dataset(tmp_path, GOOD, '{"prompt": "Spell seven. Answer:", "answer": "seven"}')
    _refused(f"{data}:2: answer 'seven' has no number for builtin:math to compare with", path=str(data),
             reward="builtin:math")
    assert len(make_task("jsonl", path=str(data), reward=f"{_rewards(tmp_path)}:score").samples) == 2  # user's: fine


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset_is_refused(content: str, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    _refused(f"dataset {data}: no samples (the file is empty)", path=str(data), reward="builtin:math")


def test_missing_dataset_is_refused(tmp_path: Path) -> None:
    _refused(f"dataset {tmp_path / 'nope.jsonl'}: no such file", path=str(tmp_path / "nope.jsonl"),
             reward="builtin:math")


@pytest.mark.parametrize(("spec", "reason"), [
    ("{dir}/missing.py:score", "no such file {dir}/missing.py"),
    ("{dir}/rewards.py:scor", "{dir}/rewards.py has no function 'scor'; it defines boom, inf, mutate, nan, nothing, "
                              "one_arg, score, text"),
    ("{dir}/rewards.py:threshold", "threshold in {dir}/rewards.py is not callable: 0.5"),
    ("{dir}/rewards.py:one_arg", "one_arg(completion) cannot be called as one_arg(completion, sample)"),
    ("{dir}/rewards.py", "expected FILE.py:FUNCTION (a function in your Python file) or builtin:NAME (builtin:math)"),
    ("{dir}/rewards.txt:score", "expected FILE.py:FUNCTION"),
    ("builtin:gsm8k", "no builtin reward 'gsm8k'; builtins: builtin:math"),
    ("{dir}/broken.py:score", "importing {dir}/broken.py raised ZeroDivisionError: division by zero"),
])
def test_bad_reward_specs_are_refused(spec: str, reason: str, tmp_path: Path) -> None:
    _rewards(tmp_path)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    spec, reason = spec.format(dir=tmp_path), reason.format(dir=tmp_path)
    message = _refused(reason, path=str(_dataset(tmp_path, GOOD)), reward=spec)
    assert message.startswith(f"task jsonl: reward {spec!r}: ")


@pytest.mark.parametrize(("function", "reason"), [
    ("boom", "reward function {spec} raised ValueError: cannot score 7 (at {dir}/rewards.py:"),
    ("nan", "reward function {spec} returned nan (float); expected a finite number"),
    ("inf", "reward function {spec} returned -inf (float); expected a finite number"),
    ("text", "reward function {spec} returned '1.0' (str); expected a finite number"),
    ("nothing", "reward function {spec} returned None (NoneType); expected a finite number"),
])
def test_reward_failures_mid_run_name_the_line(function: str, reason: str, tmp_path: Path) -> None:
    data = _dataset(tmp_path, GOOD.replace("7}", "8}"), GOOD)
    spec = f"{_rewards(tmp_path)}:{function}"
    task = make_task("jsonl", path=str(data), reward=spec)
    problem = next(s for s in task.samples if s.line == 2)
    with pytest.raises(RewardError) as e:
        task.reward(" 7", problem)
    assert str(e.value).startswith(f"{data}:2: "), str(e.value)
    assert reason.format(spec=spec, dir=tmp_path) in str(e.value), str(e.value)


def test_reward_gets_the_whole_line_as_a_copy(tmp_path: Path) -> None:
    data = _dataset(tmp_path, json.dumps({"prompt": "p", "answer": 7, "source": "mine"}))
    task = make_task("jsonl", path=str(data), reward=f"{_rewards(tmp_path)}:mutate")
    assert task.reward("x", task.samples[0]) == 0.0
    assert task.samples[0].record == {"prompt": "p", "answer": 7, "source": "mine"}
    scored = make_task("jsonl", path=str(data), reward=f"{_rewards(tmp_path)}:score")
    assert scored.reward(" 7 ", scored.samples[0]) == 1.0 and scored.reward("8", scored.samples[0]) == 0.0


@pytest.mark.parametrize(("text", "number"), [
    ("The answer is 1,234.", Fraction(1234)),
    ("1,234,567 apples", Fraction(1234567)),
    ("it is -5", Fraction(-5)),
    ("(-3)", Fraction(-3)),
    ("5-3=2", Fraction(2)),
    ("pages 10-12", Fraction(12)),
    ("3.25 then", Fraction(13, 4)),
    ("-0.5", Fraction(-1, 2)),
    ("7. Done", Fraction(7)),
    ("7, 8", Fraction(8)),
    ("7,8", Fraction(8)),
    ("x12y", Fraction(12)),
    ("#### 72", Fraction(72)),
    ("6 then 9 apples later", Fraction(9)),
    ("no number at all", None),
    ("", None),
    ("minus - sign", None),
])
def test_last_number(text: str, number: Fraction | None) -> None:
    assert last_number(text) == number


@pytest.mark.parametrize(("completion", "answer", "reward"), [
    (" 7", 7, 1.0),
    (" 7.00 apples", 7, 1.0),
    ("about 1,000", "so #### 1000", 1.0),
    ("1000", 1000.0, 1.0),
    ("0.1", 0.1, 1.0),
    ("-4", -4, 1.0),
    ("7 or 8", 7, 0.1),
    ("4", -4, 0.1),
    ("seven", 7, 0.0),
])
def test_math_reward(completion: str, answer: object, reward: float) -> None:
    assert math_reward(completion, {"prompt": "p", "answer": answer}) == reward


def test_sampling_is_drawn_from_the_run_random_alone(tmp_path: Path) -> None:
    """Two tasks on equal Randoms draw the same samples; a Random restored mid-way (what a resume does) continues
    as the uninterrupted one."""
    data = _dataset(tmp_path, *(json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(50)))
    a, b = (make_task("jsonl", path=str(data), reward="builtin:math") for _ in range(2))
    rng = random.Random(3)
    first = [a.sample(rng).line for _ in range(20)]
    state = rng.getstate()
    rest = [a.sample(rng).line for _ in range(20)]
    resumed = random.Random(99)
    resumed.setstate(state)
    assert [b.sample(resumed).line for _ in range(20)] == rest
    other = random.Random(3)
    assert [b.sample(other).line for _ in range(20)] == first
    assert len(set(first + rest)) > 10  # spread over the file, not one line


def test_word_problems_file_is_the_generators_output(tmp_path: Path) -> None:
    shipped = REPO / "configs/data/word-problems.jsonl"
    word_problems.write(tmp_path / "wp.jsonl")
    assert (tmp_path / "wp.jsonl").read_bytes() == shipped.read_bytes()
    task = make_task("jsonl", path=str(shipped), reward="builtin:math")
    assert len(task.samples) == word_problems.COUNT
    assert all(0 <= int(s.answer) <= 9 and task.reward(f" {s.answer}", s) == 1.0 for s in task.samples)


def _config(tmp_path: Path, task_args: str, task: str = "jsonl", name: str = "ppo.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"model: {REPO / 'configs/k3-tiny.yaml'}\ntask: {task}\ntask_args: {task_args}\nsteps: 5\n")
    return path


def test_shipped_jsonl_configs_load() -> None:
    cfg = load_ppo_config(REPO / "configs/ppo-tiny-jsonl.yaml")
    assert cfg.task_args == {"path": str(REPO / "configs/data/word-problems.jsonl"), "reward": "builtin:math"}
    cfg = load_ppo_config(REPO / "configs/ppo-tiny-jsonl-reward.yaml")
    assert cfg.task_args["reward"] == f"{REPO / 'configs/rewards/example_reward.py'}:score"
    task = make_task(cfg.task, **cfg.task_args)
    assert task.reward(f" {task.samples[0].answer}", task.samples[0]) == 1.0


def test_relative_task_paths_resolve_against_the_config_directory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    project.mkdir()
    _dataset(project, GOOD)
    _rewards(project)
    config = _config(project / "configs", "{path: ../data.jsonl, reward: '../rewards.py:score'}")
    monkeypatch.chdir(tmp_path)  # not the config's directory
    cfg = load_ppo_config(config)
    assert Path(cfg.task_args["path"]).resolve() == (project / "data.jsonl").resolve()
    task = make_task(cfg.task, **cfg.task_args)
    assert task.reward(" 7", task.samples[0]) == 1.0


@pytest.mark.parametrize(("task", "task_args", "says"), [
    ("jsonl", "{path: data.jsonl, reward: 'builtin:math', shuffle: true}",
     "task jsonl: unknown task_args key(s) 'shuffle'; accepted: path (a string), reward (a string)"),
    ("jsonl", "{path: 5, reward: 'builtin:math'}", "task jsonl: task_args path must be a string, got 5"),
    ("jsonl", "{reward: 'builtin:math'}", "task jsonl: task_args needs 'path'; accepted: path (a string), reward"),
    ("jsonl", "{path: data.jsonl}", "task jsonl: task_args needs 'reward'"),
    ("addition", "{digits: two}", "task addition: task_args digits must be an integer, got 'two'"),
    ("addition", "{digits: 0}", "task addition: digits must be >= 1, got 0"),
    ("addition", "{length: 3}", "task addition: unknown task_args key(s) 'length'; accepted: digits (an integer)"),
    ("chess", "{}", "unknown task 'chess'; choose one of addition, calculator, env, guess, jsonl, reversal, squares"),
])
def test_task_args_are_checked_at_config_load(task: str, task_args: str, says: str, tmp_path: Path) -> None:
    _dataset(tmp_path, GOOD)
    config = _config(tmp_path, task_args, task)
    with pytest.raises(ConfigError) as e:
        load_ppo_config(config)
    assert str(e.value).startswith(f"{config}: ") and says in str(e.value), str(e.value)


def test_a_reward_error_mid_run_exits_2_naming_line_and_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The PPO command with a stand-in run (no engine) whose step scores with a failing reward function."""
    import zerokl.ppo.loop as loop

    data = _dataset(tmp_path, GOOD)
    _rewards(tmp_path)

    class Run:
        def __init__(self, cfg, out, resume, log):  # noqa: ANN001 - PPORun's signature
            out.mkdir()
            self.task, self.step = make_task(cfg.task, **cfg.task_args), 3

        def run_step(self) -> None:
            self.task.reward(" 7", self.task.samples[0])

        def close(self) -> None:
            pass

    monkeypatch.setattr(loop, "PPORun", Run)
    config = _config(tmp_path, "{path: data.jsonl, reward: 'rewards.py:boom'}")
    capsys.readouterr()
    assert main(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), "--wandb", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"zerokl: error: {data}:1: reward function {tmp_path}/rewards.py:boom raised "
                                        f"ValueError: cannot score 7 (at {tmp_path}/rewards.py:10); stopping at step 3")


def test_the_command_refuses_a_bad_dataset_before_anything_starts(tmp_path: Path) -> None:
    data = _dataset(tmp_path, GOOD, '{"prompt": "What is 1 + 1? Answer:"}')
    config = _config(tmp_path, "{path: data.jsonl, reward: 'builtin:math'}")
    out = tmp_path / "out"
    t0 = time.monotonic()
    result = subprocess.run([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(config), "--out",
                             str(out)], capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == (f"zerokl: error: {config}: task jsonl: dataset {data}:2: no 'answer' field; each line is an "
                        "object with 'prompt' (text) and 'answer' (text or a number)")
    assert not out.exists() and seconds < 10, seconds  # no checkpoint, no engine (an engine start alone takes longer)


def test_a_prompt_longer_than_the_context_is_refused_before_the_trainer_starts(tmp_path: Path, k3_tiny: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset prompt that cannot fit the rollout context with `max_tokens` is named (file and line) as soon as the
    tokenizer exists, before the trainer or the engine."""
    data = _dataset(tmp_path, GOOD, json.dumps({"prompt": "1 + 1 = " * 400, "answer": 2}))
    config = _config(tmp_path, "{path: data.jsonl, reward: 'builtin:math'}")
    config.write_text(config.read_text().replace(str(REPO / "configs/k3-tiny.yaml"), str(k3_tiny)))
    capsys.readouterr()
    t0 = time.monotonic()
    assert main(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), "--wandb", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dataset {data}:2: the prompt has " in err[0] and "tokens; at most 504 fit" in err[0], err
    assert time.monotonic() - t0 < 10
