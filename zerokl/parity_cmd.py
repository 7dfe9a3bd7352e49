"""`zerokl parity ...`: compare log-probs and say where they diverge.

`diff A.jsonl B.jsonl` compares two dumps from any source (A is the rollout / behaviour side). The exit
code is 0 only when every compared log-prob is bitwise equal, 1 when they differ, 2 for user errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.checker import ParityReport, compare, format_report, load_dump
from parity.report import write_html


def _emit(rep: ParityReport, args: argparse.Namespace, rollout, trainer, title: str, diagnosis: str | None) -> int:
    print(format_report(rep, title))
    if diagnosis:
        print(diagnosis)
    if args.json:
        payload = rep.to_json() | ({"diagnosis": diagnosis} if diagnosis else {})
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if args.report:
        print(f"report: {write_html(args.report, rep, rollout, trainer, title, diagnosis)}")
    return 0 if rep.all_equal else 1


def _run_diff(args: argparse.Namespace) -> int:
    a, b = load_dump(args.a), load_dump(args.b)
    return _emit(compare(a, b), args, a, b, f"parity diff {args.a} vs {args.b}", None)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="log-prob parity: compare, diagnose, report")
    psub = p.add_subparsers(dest="parity_command", required=True)
    d = psub.add_parser("diff", help="compare two JSONL log-prob dumps (A = rollout side, B = trainer side)")
    d.add_argument("a", help="JSONL: one {id, token_ids, logprobs} per line")
    d.add_argument("b")
    d.add_argument("--json", help="write the summary and per-sequence detail here")
    d.add_argument("--report", help="write an HTML report with the per-token plot here")
    d.set_defaults(func=_run_diff)
