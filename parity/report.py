"""The HTML parity report: summary table, diagnosis, and a per-token |d log-prob| plot per sequence
(matplotlib, embedded as a PNG so the page is one self-contained file)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parity.compare import ParityReport, SequenceLogprobs  # noqa: E402


def plot_png(rollout: list[SequenceLogprobs], trainer: list[SequenceLogprobs], max_seqs: int = 16) -> bytes:
    """PNG bytes: one line per sequence of |logp_trainer - logp_rollout| against token index (symlog y)."""
    by_id = {s.id: s for s in trainer}
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    for q in rollout[:max_seqs]:
        d = (by_id[q.id].logprobs.double() - q.logprobs.double()).abs()
        ax.plot(range(len(d)), d.numpy(), marker=".", linewidth=1, label=f"seq {q.id}")
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_xlabel("completion token index")
    ax.set_ylabel("|log p trainer - log p rollout|")
    ax.set_title("per-token log-prob difference (0 = bitwise equal)")
    ax.grid(True, alpha=0.3)
    if len(rollout) <= 8:
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_html(path: str | Path, rep: ParityReport, rollout: list[SequenceLogprobs], trainer: list[SequenceLogprobs],
               title: str, diagnosis: str | None) -> Path:
    """Write the report page; returns its path."""
    png = base64.b64encode(plot_png(rollout, trainer)).decode()
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in [("tokens compared", rep.tokens), ("bitwise equal", f"{rep.bitwise_equal} / {rep.tokens}"),
                     ("max |d|", f"{rep.max_abs_diff:.3e}"), ("mean |d|", f"{rep.mean_abs_diff:.3e}"),
                     ("KL k1 / k2 / k3", f"{rep.kl_k1:.3e} / {rep.kl_k2:.3e} / {rep.kl_k3:.3e}"),
                     ("importance ratio", f"[{rep.ratio_min:.9f}, {rep.ratio_max:.9f}]")]
    )
    verdict = "PASS: every log-prob is bitwise equal" if rep.all_equal else "FAIL: log-probs differ"
    diag = f"<h2>Diagnosis</h2><p>{html.escape(diagnosis)}</p>" if diagnosis else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td{{padding:2px 12px}}</style></head>
<body><h1>{html.escape(title)}</h1><p><b>{verdict}</b></p><table>{rows}</table>{diag}
<h2>Per-token |d log-prob|</h2><img alt="per-token log-prob difference" src="data:image/png;base64,{png}">
</body></html>
"""
    out = Path(path)
    out.write_text(page)
    return out
