"""The `zerokl` command: one entry point, one subcommand per job.

User mistakes (bad paths, bad config keys, bad flags) end with a one-line `zerokl: error: ...` and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from parity.config import ConfigError
from rollout.server import serve
from lora import cli as lora_cli
from lora.spec import AdapterError
from parity.compare import DumpError
from zerokl import parity_cli, plan
from zerokl.ppo import cli as ppo_cli
from zerokl.tasks import RewardError
from rollout.sampling import RolloutError
from parity.io.checkpoint import CheckpointError, init_checkpoint
from parity.patching import UnsupportedVersion

# a user's mistake, or an installed dependency release zerokl's patches were not written for (UnsupportedVersion)
USER_ERRORS = (ConfigError, CheckpointError, DumpError, AdapterError, FileNotFoundError, RewardError, RolloutError,
               UnsupportedVersion)


def _progress(msg: str) -> None:
    print(f"[zerokl] {msg}", file=sys.stderr, flush=True)


def _run_init_checkpoint(args: argparse.Namespace) -> int:
    out = init_checkpoint(args.config, args.out, seed=args.seed, dtype=args.dtype, progress=_progress)
    print(out)
    return 0


def _add_init_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-checkpoint", help="write a seeded random-weight checkpoint in the official format "
                                                   "(Kimi K3 or Kimi Linear, by the config's model_type)")
    p.add_argument("--config", required=True, help="model config (YAML/JSON, official HF format)")
    p.add_argument("--out", required=True, help="new checkpoint directory (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="bfloat16 or float32: the checkpoint's torch_dtype, in which the model "
                   "is stored and computed (default: the config's torch_dtype)")
    p.set_defaults(func=_run_init_checkpoint)


def _run_export(args: argparse.Namespace) -> int:
    from zerokl.ppo.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, progress=_progress))
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a `zerokl ppo` checkpoint's trained weights as an official checkpoint "
                                      "directory (servable: zerokl serve, parity check --model, vLLM)")
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest complete checkpoint) or one of its "
                                                       "checkpoints (OUT/checkpoints/step-N)")
    p.add_argument("--out", required=True, help="new checkpoint directory (must not exist or be empty)")
    p.set_defaults(func=_run_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerokl", description="RL training-inference parity toolkit for Kimi K3")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_init_checkpoint(sub)
    _add_export(sub)
    plan.add_parser(sub)
    parity_cli.add_parser(sub)
    ppo_cli.add_parser(sub)
    lora_cli.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as e:
        print(f"zerokl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
