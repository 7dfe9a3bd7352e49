"""The `zerokl` command line: real runs of the entry point, and user mistakes as one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerokl.cli import main


def test_init_checkpoint_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k3"
    assert main(["init-checkpoint", "--config", "configs/k3-tiny.yaml", "--out", str(out), "--seed", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k3"
    assert "initialised" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["init-checkpoint", "--config", "configs/nope.yaml", "--out", "X"], "config file not found"),
        (["init-checkpoint", "--config", "configs/k3-tiny.yaml", "--out", "X", "--dtype", "int8"], "--dtype must be one of"),
        (["plan", "--config", "configs/nope.yaml"], "config file not found"),
    ],
)
def test_user_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [a if a != "X" else str(tmp_path / "out") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerokl: error:") and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bad_config_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path("configs/k3-tiny.yaml").read_text().replace("hidden_act: situ", "hidden_act: gelu"))
    assert main(["init-checkpoint", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "hidden_act" in capsys.readouterr().err


def test_non_empty_out_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["init-checkpoint", "--config", "configs/k3-tiny.yaml", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("zerokl")
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "init-checkpoint" in result.stdout and "plan" in result.stdout
