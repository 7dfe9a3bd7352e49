"""`zerokl lora`: write a random test adapter, export a trained one, merge one into a checkpoint, push one into
running servers and list what they serve.

Every subcommand validates the adapter against the model's config; user mistakes raise `AdapterError` (a
ValueError) or the checkpoint / config errors, which `zerokl` prints as one line (exit 2). A push or list that a
server refuses or cannot answer prints the server's reason and what was rolled back (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora.adapter import save_adapter
from lora.init import random_adapter
from lora.merge import merge_checkpoint
from lora.push import PushError, Server, format_listing, list_servers, push
from lora.spec import MAX_RANK
from lora.state import read_state
from parity.config import load_model_config


def _progress(msg: str) -> None:
    print(f"[zerokl] {msg}", file=sys.stderr, flush=True)


def _run_init(args: argparse.Namespace) -> int:
    cfg = load_model_config(args.model)
    adapter = random_adapter(cfg.text, args.rank, args.alpha, args.targets, args.seed, args.rslora,
                             base_model=str(Path(args.model).resolve()))
    print(save_adapter(adapter, args.out, progress=_progress))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    adapter = read_state(args.state, load_model_config(args.model).text)
    print(save_adapter(adapter, args.out, progress=_progress))
    return 0


def _run_merge(args: argparse.Namespace) -> int:
    print(merge_checkpoint(args.model, args.adapter, args.out, args.dtype, progress=_progress))
    return 0


def _servers(args: argparse.Namespace) -> list[Server]:
    return [Server(url, args.api_key) for url in args.server]


def _run_push(args: argparse.Namespace) -> int:
    try:
        version = push(_servers(args), args.name, args.adapter, log=_progress)
    except PushError as e:
        print(f"zerokl: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.name}: version {version} serving on {len(args.server)} server(s)")
    return 0


def _run_list(args: argparse.Namespace) -> int:
    try:
        print(format_listing(list_servers(_servers(args))))
    except PushError as e:
        print(f"zerokl: error: {e}", file=sys.stderr)
        return 1
    return 0


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", required=True,
                   help="base URL of a `zerokl serve --lora-root` server, e.g. http://127.0.0.1:8000 (repeatable)")
    p.add_argument("--api-key", help="the servers' API key (vLLM --api-key)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `zerokl lora {init,export,merge,push,list}`."""
    p = subparsers.add_parser("lora", help="LoRA adapters in PEFT format: init, export, merge, push, list")
    sub = p.add_subparsers(dest="lora_command", required=True)

    init = sub.add_parser("init", help="write a seeded random adapter (non-zero B, so it changes outputs)")
    init.add_argument("--model", required=True, help="checkpoint directory (or model config) the adapter is for")
    init.add_argument("--out", required=True, help="new adapter directory (must not exist or be empty)")
    init.add_argument("--rank", type=int, required=True, help=f"LoRA rank r, 1..{MAX_RANK}")
    init.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank, i.e. scale 1)")
    init.add_argument("--targets", nargs="+", default=None,
                      help="module names to adapt, e.g. q_proj o_proj gate_proj (default: every supported one)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--rslora", action="store_true", help="rank-stabilised scale alpha / sqrt(r)")
    init.set_defaults(func=_run_init)

    export = sub.add_parser("export", help="write a trained adapter (the trainer's adapter state) in PEFT format")
    export.add_argument("--model", required=True, help="checkpoint directory (or model config) it was trained on")
    export.add_argument("--state", required=True, help="directory of adapter_state-tpRR-of-TT.safetensors shards")
    export.add_argument("--out", required=True, help="new adapter directory (must not exist or be empty)")
    export.set_defaults(func=_run_export)

    merge = sub.add_parser("merge", help="fold an adapter into a checkpoint (W + scale * B A); changes bits")
    merge.add_argument("--model", required=True, help="checkpoint directory")
    merge.add_argument("--adapter", required=True, help="PEFT adapter directory")
    merge.add_argument("--out", required=True, help="new checkpoint directory (must not exist or be empty)")
    merge.add_argument("--dtype", default=None,
                       help="store (and so compute) the merged model in bfloat16 or float32 (default: as the checkpoint)")
    merge.set_defaults(func=_run_merge)

    push_p = sub.add_parser("push", help="load an adapter into running servers under NAME, atomically (all or none)")
    _server_args(push_p)
    push_p.add_argument("--name", required=True, help="the model name requests use for this adapter")
    push_p.add_argument("--adapter", required=True, help="PEFT adapter directory inside the servers' --lora-root")
    push_p.set_defaults(func=_run_push)

    list_p = sub.add_parser("list", help="show the adapters each server holds")
    _server_args(list_p)
    list_p.set_defaults(func=_run_list)
