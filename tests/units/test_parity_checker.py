"""The parity checker: dump I/O, statistics, `zerokl parity diff`, the HTML report, first-divergence diagnosis."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
import torch

from parity.compare import DumpError, SequenceLogprobs, compare, load_dump, write_dump
from parity.config import load_model_config
from parity.diagnose import diagnose
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights
from parity.io.checkpoint import random_weights
from zerokl.cli import main


def _dump(seed: int, n: int = 3) -> list[SequenceLogprobs]:
    g = torch.Generator().manual_seed(seed)
    return [SequenceLogprobs(str(i), torch.randint(0, 100, (7,), generator=g).tolist(), -torch.rand(7, generator=g))
            for i in range(n)]


def test_dump_round_trip_keeps_fp32_bits(tmp_path: Path) -> None:
    seqs = _dump(0)
    write_dump(tmp_path / "a.jsonl", seqs)
    back = load_dump(tmp_path / "a.jsonl")
    assert all(torch.equal(a.logprobs, b.logprobs) and a.token_ids == b.token_ids for a, b in zip(seqs, back))


def test_stats_equal_and_perturbed() -> None:
    a = _dump(0)
    rep = compare(a, a)
    assert rep.all_equal and rep.max_abs_diff == 0 and rep.kl_k1 == 0 and rep.ratio_min == rep.ratio_max == 1.0
    b = [SequenceLogprobs(s.id, s.token_ids, s.logprobs.clone()) for s in a]
    b[1].logprobs[4] = torch.nextafter(b[1].logprobs[4], torch.tensor(0.0))
    rep = compare(a, b)
    assert not rep.all_equal and rep.bitwise_equal == rep.tokens - 1
    assert rep.sequences[1].first_mismatch == 4 and rep.max_abs_diff > 0
    r = float(b[1].logprobs[4].double() - a[1].logprobs[4].double())
    assert rep.kl_k1 == pytest.approx(-r / rep.tokens) and rep.ratio_max > 1.0


def test_diff_cli_exit_codes_json_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _dump(0)
    b = [SequenceLogprobs(s.id, s.token_ids, s.logprobs + (1e-3 if s.id == "2" else 0.0)) for s in a]
    write_dump(tmp_path / "a.jsonl", a)
    write_dump(tmp_path / "b.jsonl", b)
    assert main(["parity", "diff", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")]) == 0
    assert "PASS" in capsys.readouterr().out
    rc = main(["parity", "diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
               "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html")])
    assert rc == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert {"tokens", "bitwise_equal", "max_abs_diff", "kl_k1", "kl_k3", "sequences"} <= set(data)
    assert data["tokens"] == 21 and data["bitwise_equal"] == 14
    page = (tmp_path / "r.html").read_text()
    png = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", page).group(1))
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size[0] > 400 and img.size[1] > 200
    assert len(set(img.tobytes())) > 20  # a real plot: axes, text and lines, not a blank image


def test_diff_cli_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.jsonl").write_text('{"token_ids": [1, 2], "logprobs": [0.1]}\n')
    assert main(["parity", "diff", str(tmp_path / "bad.jsonl"), str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["parity", "diff", str(tmp_path / "none.jsonl"), str(tmp_path / "none.jsonl")]) == 2
    with pytest.raises(DumpError, match="token ids differ"):
        a = _dump(0)
        compare(a, [SequenceLogprobs(s.id, s.token_ids[::-1], s.logprobs) for s in a])


def test_diagnosis_names_the_perturbed_layer() -> None:
    """A one-ulp change to a weight of layer 5's KDA on one side: the first divergence is that block."""
    cfg = load_model_config("configs/k3-tiny.yaml")
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, torch_dtype="float32"))  # an fp32 ulp
    tensors = random_weights(cfg, seed=0)
    a = K3Weights.from_official(cfg.text, tensors)
    b = K3Weights.from_official(cfg.text, tensors)
    name = "language_model.layers.5.self_attn.o_norm.weight"
    b.tensors[name] = b.tensors[name].clone()
    b.tensors[name][3] = torch.nextafter(b.tensors[name][3], torch.tensor(10.0))
    seq = list(range(10, 40))
    same = diagnose((K3Forward(a, INVARIANT), "decode"), (K3Forward(a, INVARIANT), "one_pass"), seq)
    assert same is None  # schedules alone never diverge
    div = diagnose((K3Forward(b, INVARIANT), "decode"), (K3Forward(a, INVARIANT), "one_pass"), seq)
    assert div is not None and div.block == "layer5.attn" and div.kind == "KDA attention"
    assert "layer5.attn" in div.describe()
