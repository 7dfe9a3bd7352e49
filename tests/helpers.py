"""Helpers several test modules use: bit-equality assertions that say where bits differ, two-rank torchrun checks, a
free local port, a vLLM server process for the test's duration, and the settings and shapes of what the session shares
(conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


# The shared engine's (and, but for the match unit, the shared server's) settings: prefix caching with a 16-token match
# unit, below the 128-token cache block, so prefix hits can also land inside a block; up to 16 sequences; LoRA with 2
# slots of rank <= 8.
K3_ENGINE_ARGS = {"max_model_len": 1024, "max_num_seqs": 16, "enable_prefix_caching": True, "prefix_match_unit": 16}
K3_LORA_ARGS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
# the reward rises within it (seed 0): first 8 steps 0.07 -> next 8 0.24 on AVX-512, 0.064 -> 0.098 on AVX2
PPO_REFERENCE_STEPS = 16
PPO_REFERENCE_CONFIG = "configs/ppo-tiny-mxfp4.yaml"  # the run the PPO modules compare with
PPO_REFERENCE_CHECKPOINTS = (2, 4)
# "ok" lines tests/dist/trainer_parallel.py prints on success (two modules run it:
# tests/trainers/test_trainer_parallel.py and tests/engines/test_kimi_linear_engines.py)
TRAINER_PARALLEL_CHECKS = 12


@dataclass(frozen=True)
class PPOReference:
    """A finished `zerokl ppo` run (the `ppo_reference` fixture): its per-step metrics and its run directory
    (`checkpoints/step-N`)."""

    metrics: list[dict]
    out: Path


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """'equal', or the first index where the bits differ and the max |a - b| (in float64)."""
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return "equal"
    idx = tuple(diff[0].tolist())
    return f"first mismatch at {idx}, max |d| = {(a.double() - b.double()).abs().max().item():.3e}"


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """`torch.equal`, failing with `first_mismatch`."""
    assert torch.equal(a, b), first_mismatch(a, b)


def torchrun_checks(script: Path, args: Sequence[str], checks: int, timeout: float = 300, nproc: int = 2,
                    env: dict[str, str] | None = None) -> str:
    """Run `script` on `nproc` local ranks (`torchrun --nproc_per_node`, gloo, one thread each, `env` added to the
    environment) and require exit 0 with `checks` lines starting "ok  " on stdout; returns stdout. A timeout kills
    torchrun and its workers (their own process group) and fails with their output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone", str(script),
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {script.name} {' '.join(args)} timed out after {timeout:.0f} s:\n{out}\n{err[-6000:]}")
    ok = [line for line in out.splitlines() if line.startswith("ok  ")]
    assert proc.returncode == 0 and len(ok) == checks, f"rc={proc.returncode}\n{out}\n{err[-6000:]}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(argv: Sequence[str], port: int, log: Path, start_timeout: float = 240) -> Iterator[str]:
    """Start a server command (`zerokl serve` or vLLM's api_server) listening on `port`; yields its base URL once
    `/health` answers; SIGTERM (then SIGKILL) at exit. Its output goes to `log`, quoted if it dies early."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, f"server did not start in {start_timeout:.0f} s"
                time.sleep(1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ppo_config_file(out: Path, base: str, checkpoint: Path, steps: int, checkpoint_every: int = 2,
                    **keys: object) -> Path:
    """The PPO config `base` (a path under the repo) run on `checkpoint` for `steps` steps, a checkpoint every
    `checkpoint_every`, no wandb, `keys` set (replaced where the file has them, else added), written to
    `out/ppo.yaml`."""
    text = (Path(__file__).resolve().parents[1] / base).read_text()
    for key, value in (("model", checkpoint), ("steps", steps), ("checkpoint_every", checkpoint_every),
                       ("wandb", "disabled"), *keys.items()):
        text, found = re.subn(rf"^{key}: .*$", f"{key}: {value}", text, count=1, flags=re.M)
        if not found:
            text += f"\n{key}: {value}\n"
    path = out / "ppo.yaml"
    path.write_text(text)
    return path


def without_chat_template(checkpoint: Path, out: Path) -> Path:
    """`out`: a copy of `checkpoint`'s config and tokenizer as written before K3's chat format (no chat template)."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint / name, out)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def picture(w: int, h: int, seed: int, mode: str = "RGB") -> Any:
    """Coloured squares on a background (a picture, not noise), in `mode`."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(im)
    for _ in range(3):
        x, y, s = rng.randrange(w), rng.randrange(h), rng.randrange(2, max(3, min(w, h) // 2))
        draw.rectangle([x, y, x + s, y + s], fill=tuple(rng.randrange(256) for _ in range(3)))
    return im.convert(mode)


def assert_zero_kl_step(result: Any) -> None:
    """A PPO step (`StepResult`) whose every sampled log-prob, processed and raw, and every expert choice were the
    trainer's bit for bit."""
    m = result.metrics
    assert result.diagnosis is None and m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 \
        and m["raw_bitwise_equal_frac"] == 1.0 and m["routing_agreement"] == 1.0, m


def assert_resumes_bitwise(cfg: Any, out: Path, state: Path, next_metrics: dict, final: dict) -> None:
    """A run of `cfg` resumed from `state` into `out` reproduces the next step's metrics (all but wall-clock ones) and
    the final weights `final` bit for bit."""
    import torch

    from zerokl.ppo.metrics import TIMING_KEYS
    from zerokl.ppo.loop import PPORun

    resumed = PPORun(cfg, out, resume=state, log=lambda _: None)
    try:
        again = resumed.run_step()
        final_again = resumed.backend.export_official()
    finally:
        resumed.close()
    assert {k: v for k, v in again.metrics.items() if k not in TIMING_KEYS} == \
        {k: v for k, v in next_metrics.items() if k not in TIMING_KEYS}
    assert final.keys() == final_again.keys() and all(torch.equal(final[n], final_again[n]) for n in final)
