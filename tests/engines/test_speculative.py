"""Speculative decoding with K3's MTP draft (k3-tiny-mxfp4 carries one MTP layer) and a DSpark draft checkpoint
under bitwise parity.

- The KDA trail (`parity.model.KDACache.trail`): in a verify chunk [t0, d1, d2, d3] the conv window and state after
  the first a tokens are the state of decoding those a tokens alone, bit for bit, for every a (the state the rollout
  resumes from after a rejection, `rollout.vllm.caches.KDAStateLayer`), and the chunk's hidden states are plain decoding's.
- `zerokl parity check --speculative` (MTP, 3 tokens, probabilistic drafts, batched and alone): every log-prob is the
  trainer's, bit for bit, and drafts were both accepted and rejected; on the fast kernels the log-probs differ. The
  same with a DSpark draft (`{"method": "dspark", "model": DRAFT, ...}`).
- `zerokl ppo` with `speculative` (configs/ppo-tiny-mtp.yaml), sampling truncated by top-k and top-p: zero KL every
  step, the drafts' acceptance in the metrics.
- Bad speculative settings are refused before anything starts.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parity.io.checkpoint import load_checkpoint
from parity.kernels import get_kernels
from parity.caches import KDACache, new_cache
from parity.model import K3Forward, K3Weights
from zerokl.cli import main
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.loop import PPORun

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # engines and trainers of two parity checks
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"})


def _kda_states(caches: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(c.conv, c.state) for c in caches if isinstance(c, KDACache)]


def test_verify_chunk_trail_is_the_accepted_tokens_state(k3_tiny_mxfp4: Path) -> None:
    cfg, weights = load_checkpoint(k3_tiny_mxfp4)
    fwd = K3Forward(K3Weights.from_official(cfg.text, weights), get_kernels("invariant"))
    prompt, chunk = [5, 300, 17, 42, 9, 611, 80], [33, 700, 12, 401]
    prefilled = new_cache(cfg.text, 1, fwd.dtype)
    fwd.hidden(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1), torch.tensor([len(prompt)]), prefilled)
    verify = copy.deepcopy(prefilled)
    for cache in verify:
        if isinstance(cache, KDACache):
            cache.trail = []
    pos = torch.arange(len(prompt), len(prompt) + len(chunk)).view(1, -1)
    chunk_hidden = fwd.hidden(torch.tensor([chunk]), pos, torch.tensor([len(chunk)]), verify)
    trails = [c.trail for c in verify if isinstance(c, KDACache)]
    assert len(trails) == len(cfg.text.kda_layers) and all(len(t) == len(chunk) for t in trails)
    alone = copy.deepcopy(prefilled)
    for a, token in enumerate(chunk, start=1):  # decode the first a tokens one by one: the accepted-only state
        hidden = fwd.hidden(torch.tensor([[token]]), pos[:, a - 1 : a], torch.tensor([1]), alone)
        assert torch.equal(hidden[0, 0], chunk_hidden[0, a - 1])
        for (conv, state), trail in zip(_kda_states(alone), trails):
            assert torch.equal(trail[a - 1][0], conv) and torch.equal(trail[a - 1][1], state)


def test_mtp_drafts_keep_every_logprob_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    common = ["parity", "check", "--model", str(k3_tiny_mxfp4), "--speculative", SPEC, "--batch-mix", "both"]
    rc = main([*common, "--num-prompts", "8", "--max-tokens", "24", "--json", str(tmp_path / "spec.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "spec.json").read_text())
    assert rc == 0 and data["bitwise_equal"] == data["tokens"] > 0 and "mtp drafts x3" in out, out
    assert 0 < data["draft_tokens_accepted"] < data["draft_tokens"], data  # acceptances and rejections both happened
    rc = main([*common, "--num-prompts", "4", "--max-tokens", "12", "--kernels", "fast", "--no-diagnose",
               "--json", str(tmp_path / "fast.json")])
    fast = json.loads((tmp_path / "fast.json").read_text())
    assert rc == 1 and fast["bitwise_equal"] < fast["tokens"] and fast["draft_tokens"] > 0, fast


def test_dspark_drafts_keep_every_logprob_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A DSpark draft checkpoint (configs/k3-tiny-dspark.yaml, reading target layers 1, 4, 7) drafting 3 tokens on
    vLLM's V1 runner (`rollout.vllm.dspark`): every log-prob the trainer's, batched and alone, with acceptances and
    rejections; on the fast kernels the log-probs differ."""
    from parity.io.checkpoint import init_checkpoint

    draft = init_checkpoint(REPO / "configs" / "k3-tiny-dspark.yaml", tmp_path / "draft", seed=1)
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 3})
    common = ["parity", "check", "--model", str(k3_tiny_mxfp4), "--speculative", spec, "--num-prompts", "4",
              "--max-tokens", "16"]
    rc = main([*common, "--batch-mix", "both", "--json", str(tmp_path / "spec.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "spec.json").read_text())
    assert rc == 0 and data["bitwise_equal"] == data["tokens"] > 0 and "dspark drafts x3" in out, out
    assert 0 < data["draft_tokens_accepted"] < data["draft_tokens"], data
    rc = main([*common, "--kernels", "fast", "--no-diagnose", "--json", str(tmp_path / "fast.json")])
    fast = json.loads((tmp_path / "fast.json").read_text())
    assert rc == 1 and fast["bitwise_equal"] < fast["tokens"] and fast["draft_tokens"] > 0, fast


def test_ppo_with_mtp_drafts_keeps_zero_kl(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny-mtp.yaml"), model=str(k3_tiny_mxfp4), steps=2,
                  prompts_per_step=4, wandb="disabled", top_k=50, top_p=0.9)  # truncated: the rejection sampler's too
    run = PPORun(cfg, tmp_path / "run", log=lambda _: None)
    try:
        metrics = [run.run_step().metrics for _ in range(2)]
    finally:
        run.close()
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0, m
        assert m["draft_tokens"] > 0 and 0.0 < m["draft_acceptance"] < 1.0, m


def test_bad_speculative_settings_are_refused(k3_tiny_mxfp4: Path, k3_tiny: Path, kimi_linear_tiny: Path,
                                              capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """One `zerokl: error:` line, exit 2, before any engine or trainer starts."""
    two_mtp = tmp_path / "two-mtp"  # a config with two MTP layers (the checks read the config and tokenizer alone)
    two_mtp.mkdir()
    for f in k3_tiny_mxfp4.iterdir():
        if f.suffix == ".json":
            (two_mtp / f.name).write_bytes(f.read_bytes())
    config = json.loads((k3_tiny_mxfp4 / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 2
    (two_mtp / "config.json").write_text(json.dumps(config))
    cases = [(k3_tiny_mxfp4, "{method: mtp}", "not JSON"),
             (k3_tiny_mxfp4, '["mtp"]', "a JSON object"),
             (k3_tiny_mxfp4, '{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of mtp, dspark"),
             (k3_tiny_mxfp4, '{"method": "mtp", "num_speculative_tokens": 6}', "integer 1..5"),
             (k3_tiny_mxfp4, '{"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "top"}',
              "draft_sample_method must be one of"),
             (k3_tiny_mxfp4, '{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "takes no model"),
             (k3_tiny_mxfp4, '{"method": "mtp", "num_speculative_tokens": 2, "draft": "x"}', "unknown keys ['draft']"),
             (k3_tiny_mxfp4, '{"method": "dspark", "num_speculative_tokens": 2}', "needs the draft checkpoint's"),
             (k3_tiny_mxfp4, f'{{"method": "dspark", "num_speculative_tokens": 2, "model": "{k3_tiny}"}}',
              "model_type must be 'k3_dspark'"),
             (k3_tiny, '{"method": "mtp", "num_speculative_tokens": 2}', "num_nextn_predict_layers is 0"),
             (two_mtp, '{"method": "mtp", "num_speculative_tokens": 3}',
              "num_speculative_tokens 3 must be a multiple of the checkpoint's 2 MTP layers"),
             (kimi_linear_tiny, '{"method": "mtp", "num_speculative_tokens": 2}', "this one is kimi_linear")]
    for ckpt, spec, message in cases:
        assert main(["parity", "check", "--model", str(ckpt), "--speculative", spec]) == 2, spec
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    serve = [(["--speculative", "{bad"], "not JSON"),
             (["--speculative", SPEC, "--", "--enable-prefix-caching"], "drop --enable-prefix-caching"),
             (["--", "--speculative-config", SPEC], "pass speculative decoding as --speculative JSON")]
    for args, message in serve:
        assert main(["serve", "--checkpoint", str(k3_tiny_mxfp4), *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels run here (interpreted): refused with drafts
    rc = main(["parity", "check", "--model", str(k3_tiny_mxfp4), "--kernels", "triton", "--speculative", SPEC])
    err = capsys.readouterr().err
    assert rc == 2 and "not the Triton kernels" in err, err


def test_ppo_refuses_drafts_it_cannot_keep_at_zero_kl(k3_tiny: Path) -> None:
    from parity.config import ConfigError

    cfg = load_ppo_config(REPO / "configs/ppo-tiny-mtp.yaml")
    for change, message in [({"task": "guess", "task_args": {}}, "an agent task"),
                            ({"min_p": 0.1}, "min_p"),
                            ({"num_rollout_servers": 1}, "rollout servers"),
                            ({"speculative": {"method": "mtp", "num_speculative_tokens": 9}}, "integer 1..5"),
                            ({"model": str(k3_tiny)}, "num_nextn_predict_layers is 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            replace(cfg, **change)
