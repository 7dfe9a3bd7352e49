"""`zerokl parity ...`: compare log-probs and say where they diverge.

- `check`: sample with the vLLM rollout engine, score the same tokens with the Megatron trainer (in this process, or
  at `--tp N` on N local ranks), compare.
- `selftest`: one-ulp weight perturbations on the rollout side only must be detected and localised.
- `diff A.jsonl B.jsonl`: compare two dumps from any source (A is the rollout / behaviour side).
- `kernels`: the CPU kernel invariances that rest on this host's BLAS and SIMD kernels, checked here.
Exit code: 0 only when every compared log-prob is bitwise equal (selftest: every trial detected and
localised; kernels: every check bit-equal), 1 otherwise, 2 for user errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.compare import ParityReport, compare, format_report, load_dump
from parity.config import ConfigError
from zerokl.argtypes import kernel_set, positive_int, temperature
from parity.report import write_html


def _emit(rep: ParityReport, args: argparse.Namespace, rollout, trainer, title: str, diagnosis: str | None,
          extra: dict | None = None) -> int:
    print(format_report(rep, title))
    if diagnosis:
        print(diagnosis)
    if args.json:
        payload = rep.to_json() | ({"diagnosis": diagnosis} if diagnosis else {}) | (extra or {})
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if args.report:
        print(f"report: {write_html(args.report, rep, rollout, trainer, title, diagnosis)}")
    return 0 if rep.all_equal else 1


def _run_diff(args: argparse.Namespace) -> int:
    a, b = load_dump(args.a), load_dump(args.b)
    return _emit(compare(a, b), args, a, b, f"parity diff {args.a} vs {args.b}", None)


def _checker(args: argparse.Namespace, lora: str | None = None):
    from zerokl.engine_check import ENGINE_ARGS, Checker

    engine_args = dict(ENGINE_ARGS)
    if getattr(args, "speculative", None) is not None:
        engine_args["speculative_config"] = args.speculative
    if getattr(args, "enforce_eager", False):
        engine_args["enforce_eager"] = True
    return Checker(args.model, kernels=args.kernels, engine_args=engine_args, lora=lora, tp=getattr(args, "tp", 1))


def _speculative(args: argparse.Namespace) -> None:
    """Check --speculative against the checkpoint (in place: vLLM's speculative_config) before anything starts."""
    from parity.config import load_model_config
    from rollout.speculative import check_speculative, parse_speculative

    if args.speculative is None:
        return
    args.speculative = check_speculative(parse_speculative(args.speculative), load_model_config(args.model).text,
                                         args.kernels, "--speculative")


def _prompts(args: argparse.Namespace) -> list:
    """The prompts, read and checked before any engine or trainer starts."""
    from tokenizers import Tokenizer

    from parity.config import load_model_config
    from zerokl.engine_check import ENGINE_ARGS, load_prompts, task_prompts

    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {args.model}: not a checkpoint directory (no config.json)")
    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    if args.prompts:
        return load_prompts(args.prompts, tokenizer, load_model_config(args.model).text.vocab_size,
                            ENGINE_ARGS["max_model_len"] - args.max_tokens, args.model)
    return task_prompts(args.num_prompts, args.seed, tokenizer)


def _run_check(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    _speculative(args)
    if getattr(args, "tp", 1) > 1 and any(not isinstance(p, list) for p in prompts):
        raise ConfigError(f"image prompts with --tp {args.tp} are not built: the TP ranks score token ids only")
    checker = _checker(args, args.lora)
    try:
        res = checker.check(prompts, mix=args.batch_mix, max_tokens=args.max_tokens,
                            temperature=args.temperature, seed=args.seed, diagnose_failures=args.diagnose)
        drafted, accepted = checker.engine.draft_counts()
    finally:
        checker.close()
    extra = {}
    if args.speculative is not None:
        print(f"drafts: {drafted} proposed, {accepted} accepted ({accepted / max(drafted, 1):.1%}), "
              f"{drafted - accepted} rejected")
        extra = {"draft_tokens": drafted, "draft_tokens_accepted": accepted}
    diagnosis = res.diagnosis.describe() if res.diagnosis else None
    if res.mix_mismatch:
        diagnosis = (diagnosis + "; " if diagnosis else "") + \
            f"{res.mix_mismatch} sequences differ between batched and alone rollouts"
    lora = f", LoRA {args.lora}" if args.lora else ""
    trainer = f"trainer TP = {args.tp}, " if args.tp > 1 else ""
    spec = "" if args.speculative is None else \
        f", {args.speculative['method']} drafts x{args.speculative['num_speculative_tokens']}"
    title = f"parity check {args.model}{lora} ({trainer}kernels {args.kernels}, batch mix {args.batch_mix}{spec})"
    rc = _emit(res.report, args, res.rollout, res.trainer, title, diagnosis, extra)
    return rc if not res.mix_mismatch else 1


def _run_selftest(args: argparse.Namespace) -> int:
    from zerokl.engine_check import selftest

    prompts = _prompts(args)
    checker = _checker(args)
    try:
        trials = selftest(checker, prompts, trials=args.trials, seed=args.seed,
                          max_tokens=args.max_tokens, temperature=args.temperature)
    finally:
        checker.close()
    ok = sum(t.ok for t in trials)
    redraws = sum(t.redraws for t in trials)
    print(f"selftest: {ok}/{len(trials)} one-ulp perturbations detected and localised to the right block "
          f"({redraws} draws changed no log-prob and were redrawn)")
    if args.json:
        Path(args.json).write_text(json.dumps([t.__dict__ | {"ok": t.ok} for t in trials], indent=2))
    return 0 if ok == len(trials) else 1


def _run_kernels(args: argparse.Namespace) -> int:
    from parity import host_check

    print(f"host: {host_check.host_description()}")
    results = host_check.run(args.seed)
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    failed = sum(not r.ok for r in results)
    print(f"kernels: {len(results) - failed}/{len(results)} host-dependent invariances hold on this machine")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0 if not failed else 1


def _add_check_args(p: argparse.ArgumentParser, num_prompts: int, max_tokens: int) -> None:
    p.add_argument("--model", required=True, help="official-format checkpoint directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", help='JSONL, one {"prompt": text} or {"prompt_token_ids": [...]} per line, '
                     'optionally with "images": [paths relative to the file] (K3 checkpoints with a vision tower), '
                     'or a chat line {"messages": [...], "tools": [...]} rendered by the checkpoint\'s chat template '
                     '(image_url parts: paths relative to the file)')
    src.add_argument("--num-prompts", type=positive_int, default=num_prompts, help="prompts from the shipped task")
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens)
    p.add_argument("--temperature", type=temperature, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", type=kernel_set, default="invariant",
                   help="invariant (default), triton (the Triton kernels on both sides: CUDA, or TRITON_INTERPRET=1 "
                        "on CPU), or fast: both sides on plain torch ops (the mismatch zerokl removes)")
    p.add_argument("--json", help="write the results here")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="log-prob parity: compare, diagnose, report")
    psub = p.add_subparsers(dest="parity_command", required=True)
    c = psub.add_parser("check", help="rollout engine vs trainer: every sampled token's log-prob, bit for bit")
    _add_check_args(c, num_prompts=16, max_tokens=32)
    c.add_argument("--batch-mix", choices=("random", "alone", "both"), default="both")
    c.add_argument("--lora", help="PEFT adapter directory: both sides run the model with this adapter")
    c.add_argument("--report", help="write an HTML report with the per-token plot here")
    c.add_argument("--tp", type=positive_int, default=1,
                   help="score with the Megatron trainer at this tensor parallelism, on as many local ranks")
    c.add_argument("--no-diagnose", dest="diagnose", action="store_false",
                   help="skip the first-divergence diagnosis on failure")
    c.add_argument("--speculative", metavar="JSON",
                   help='roll out with speculative decoding: {"method": "mtp" (the checkpoint\'s MTP layers) or '
                        '"dspark" (with "model": a DSpark draft checkpoint), "num_speculative_tokens": 1-5, '
                        '"draft_sample_method": "probabilistic" (default) or "greedy"}; verified on the parity kernels')
    c.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every decode step eagerly instead of replaying vLLM's CUDA graphs (the same "
                        "bits either way)")
    c.set_defaults(func=_run_check)
    st = psub.add_parser("selftest", help="one-ulp rollout-side weight perturbations must be detected and localised")
    _add_check_args(st, num_prompts=8, max_tokens=16)
    st.add_argument("--trials", type=positive_int, default=20)
    st.set_defaults(func=_run_selftest)
    d = psub.add_parser("diff", help="compare two JSONL log-prob dumps (A = rollout side, B = trainer side)")
    d.add_argument("a", help="JSONL: one {id, token_ids, logprobs} per line")
    d.add_argument("b")
    d.add_argument("--json", help="write the summary and per-sequence detail here")
    d.add_argument("--report", help="write an HTML report with the per-token plot here")
    d.set_defaults(func=_run_diff)
    k = psub.add_parser("kernels", help="check here the kernel invariances that rest on this CPU's BLAS / SIMD "
                                        "kernels (seconds; no model needed)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", help="write the results here")
    k.set_defaults(func=_run_kernels)
