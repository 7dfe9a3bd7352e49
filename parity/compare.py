"""Compare per-token log-probs from two sources (rollout vs trainer, or any two dumps) and summarise.

A dump is JSONL, one sequence per line:
    {"id": str | int, "token_ids": [int, ...], "logprobs": [float, ...], "prompt_token_ids": [...]?}
`logprobs[i]` is the log-prob of `token_ids[i]`. Values are fp32; JSON's shortest-repr doubles
round-trip fp32 exactly, so a dump loses no bits.

With samples drawn from the rollout policy q and r = log p_trainer - log q_rollout per token, the KL
estimates of KL(q || p) are k1 = mean(-r), k2 = mean(r^2 / 2), k3 = mean(exp(r) - 1 - r); the importance
ratios are exp(r). Under parity every r is exactly 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


class DumpError(ValueError):
    """A malformed log-prob dump; the message names the file and line."""


@dataclass(frozen=True)
class SequenceLogprobs:
    """One sequence's sampled token ids and their fp32 log-probs (held on the CPU, wherever they were computed: the
    rollout's and the trainer's are compared there)."""

    id: str
    token_ids: list[int]
    logprobs: torch.Tensor  # [n] fp32
    prompt_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprobs", self.logprobs.cpu())


@dataclass(frozen=True)
class SequenceDiff:
    id: str
    tokens: int
    bitwise_equal: int
    max_abs_diff: float
    first_mismatch: int | None  # token index of the first differing log-prob


@dataclass(frozen=True)
class ParityReport:
    """The summary `zerokl parity` prints and writes (`--json`); keys are stable."""

    tokens: int
    bitwise_equal: int
    max_abs_diff: float
    mean_abs_diff: float
    kl_k1: float
    kl_k2: float
    kl_k3: float
    ratio_min: float
    ratio_max: float
    sequences: list[SequenceDiff]

    @property
    def all_equal(self) -> bool:
        return self.tokens > 0 and self.bitwise_equal == self.tokens

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_dump(path: str | Path) -> list[SequenceLogprobs]:
    """Read a JSONL dump; every line must be an object with `token_ids` (ints) and as many `logprobs` (numbers, none
    NaN or +inf), an optional unique `id` and optional `prompt_token_ids` (ints). Fails on the first bad line, naming
    the file, the line and the reason (`DumpError`)."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no such file")
    seqs: list[SequenceLogprobs] = []
    seen: set[str] = set()
    for lineno, row in jsonl_rows(path):
        where = f"{path}:{lineno}"
        seq = _sequence(row, where, default_id=str(lineno - 1))
        if seq.id in seen:
            raise DumpError(f"{where}: id {seq.id!r} appears twice in the dump")
        seen.add(seq.id)
        seqs.append(seq)
    if not seqs:
        raise DumpError(f"{path}: no sequences")
    return seqs


def jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line of a JSONL file; a line that is not UTF-8 or not JSON fails
    (`DumpError`) naming the file and line."""
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DumpError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DumpError(f"{path}:{lineno}: not JSON ({e})") from None


def _sequence(row: Any, where: str, default_id: str) -> SequenceLogprobs:
    if not isinstance(row, dict) or "token_ids" not in row or "logprobs" not in row:
        raise DumpError(f"{where}: expected an object with token_ids and logprobs")
    ids, lps = _int_list(row["token_ids"], "token_ids", where), row["logprobs"]
    if not isinstance(lps, list) or len(ids) != len(lps):
        raise DumpError(f"{where}: {len(ids)} token_ids but logprobs is "
                        f"{f'a list of {len(lps)}' if isinstance(lps, list) else repr(lps)}")
    for i, v in enumerate(lps):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise DumpError(f"{where}: logprobs[{i}] = {v!r} is not a number")
        if math.isnan(v) or v == math.inf:
            raise DumpError(f"{where}: logprobs[{i}] is {v}: the source produced no log-prob for token {ids[i]}")
    seq_id = row.get("id", default_id)
    if isinstance(seq_id, bool) or not isinstance(seq_id, (str, int)):
        raise DumpError(f"{where}: id must be a string or an integer, got {seq_id!r}")
    prompt = _int_list(row.get("prompt_token_ids", []), "prompt_token_ids", where)
    return SequenceLogprobs(str(seq_id), ids, torch.tensor(lps, dtype=torch.float32), prompt)


def _int_list(value: Any, key: str, where: str) -> list[int]:
    if not isinstance(value, list):
        raise DumpError(f"{where}: {key} must be a list of token ids, got {value!r}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise DumpError(f"{where}: {key}[{i}] = {t!r} is not a token id (an integer >= 0)")
    return value


def write_dump(path: str | Path, seqs: list[SequenceLogprobs]) -> None:
    lines = [json.dumps({"id": s.id, "prompt_token_ids": s.prompt_token_ids, "token_ids": s.token_ids,
                         "logprobs": s.logprobs.tolist()}) for s in seqs]
    Path(path).write_text("\n".join(lines) + "\n")


def compare(rollout: list[SequenceLogprobs], trainer: list[SequenceLogprobs]) -> ParityReport:
    """Match sequences by id and compare token by token (bits via `==` on fp32)."""
    by_id = {s.id: s for s in trainer}
    missing = [s.id for s in rollout if s.id not in by_id]
    if missing or len(rollout) != len(trainer):
        raise DumpError(f"the two dumps hold different sequences (unmatched ids: {missing[:5]})")
    diffs, rs, abs_all = [], [], []
    for q in rollout:
        p = by_id[q.id]
        if q.token_ids != p.token_ids:
            raise DumpError(f"sequence {q.id}: token ids differ between the dumps; compare log-probs of the same tokens")
        r = p.logprobs.double() - q.logprobs.double()
        eq = q.logprobs == p.logprobs
        bad = (~eq).nonzero()
        diffs.append(SequenceDiff(q.id, len(q.token_ids), int(eq.sum()), float(r.abs().max()) if len(r) else 0.0,
                                  int(bad[0]) if len(bad) else None))
        rs.append(r)
        abs_all.append(r.abs())
    r_all = torch.cat(rs) if rs else torch.zeros(0, dtype=torch.float64)
    n = r_all.numel()
    ratio = torch.exp(r_all)
    return ParityReport(
        tokens=n,
        bitwise_equal=sum(d.bitwise_equal for d in diffs),
        max_abs_diff=float(r_all.abs().max()) if n else 0.0,
        mean_abs_diff=float(r_all.abs().mean()) if n else 0.0,
        kl_k1=float((-r_all).mean()) if n else 0.0,
        kl_k2=float((r_all.pow(2) / 2).mean()) if n else 0.0,
        kl_k3=float((ratio - 1 - r_all).mean()) if n else 0.0,
        ratio_min=float(ratio.min()) if n else 1.0,
        ratio_max=float(ratio.max()) if n else 1.0,
        sequences=diffs,
    )


def format_report(rep: ParityReport, title: str = "parity") -> str:
    """The summary table printed by `zerokl parity check|diff`."""
    verdict = "PASS: every log-prob is bitwise equal" if rep.all_equal else "FAIL: log-probs differ"
    rows = [
        ("sequences", f"{len(rep.sequences)}"),
        ("tokens compared", f"{rep.tokens}"),
        ("bitwise equal", f"{rep.bitwise_equal} / {rep.tokens}"),
        ("max |d logprob|", f"{rep.max_abs_diff:.3e}"),
        ("mean |d logprob|", f"{rep.mean_abs_diff:.3e}"),
        ("KL k1 / k2 / k3", f"{rep.kl_k1:.3e} / {rep.kl_k2:.3e} / {rep.kl_k3:.3e}"),
        ("importance ratio", f"[{_fmt_ratio(rep.ratio_min)}, {_fmt_ratio(rep.ratio_max)}]"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"== {title}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    worst = sorted((d for d in rep.sequences if d.first_mismatch is not None), key=lambda d: -d.max_abs_diff)[:5]
    for d in worst:
        lines.append(f"  seq {d.id}: first mismatch at token {d.first_mismatch}, max |d| {d.max_abs_diff:.3e}")
    lines.append(verdict)
    return "\n".join(lines)


def _fmt_ratio(x: float) -> str:
    return "1 (exact)" if x == 1.0 else f"{x:.9f}" if math.isfinite(x) else str(x)
