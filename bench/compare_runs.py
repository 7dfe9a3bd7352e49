"""Two `zerokl ppo` runs of one config, the second resumed from a checkpoint of the first: are they the same run?

Every metric but the timings (`zerokl.ppo.metrics.TIMING_KEYS`) of each step the resumed run logged against the same
step of the first, and every tensor of every `.pt` and `.safetensors` file of checkpoint NAME in both (`torch.equal`:
bits, dtypes, shapes; a run on several processes keeps each rank's weights in `weights-rank{r}.safetensors`). Exit 0
when all are equal, 1 otherwise.

    python bench/compare_runs.py RUN_DIR RESUMED_DIR step-20
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerokl.ppo.metrics import TIMING_KEYS  # noqa: E402


def metrics(run: Path) -> dict[int, dict[str, Any]]:
    """A run's metrics by step, timings left out."""
    with open(run / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {m["step"]: {k: v for k, v in m.items() if k not in TIMING_KEYS} for m in rows}


def tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a saved object, named by its path through dicts and lists."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}[{i}]")


def load(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint file's tensors by name (`.safetensors`, or a `.pt` loaded without unpickling code)."""
    if path.suffix == ".safetensors":
        return load_file(path)
    return dict(tensors(torch.load(path, map_location="cpu", weights_only=True)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=Path)
    p.add_argument("resumed", type=Path)
    p.add_argument("checkpoint", help="a checkpoint both runs wrote, e.g. step-20")
    a = p.parse_args()
    first, resumed = metrics(a.first), metrics(a.resumed)
    steps = sorted(resumed)
    differ = [s for s in steps if first.get(s) != resumed[s]]
    print(f"metrics of steps {steps[0]}-{steps[-1]}: {len(steps) - len(differ)}/{len(steps)} equal" if steps
          else "the resumed run logged no steps")
    for s in differ[:3]:
        print(f"  step {s}:", {k: (v, first.get(s, {}).get(k)) for k, v in resumed[s].items()
                               if v != first.get(s, {}).get(k)})
    root_a, root_b = a.first / "checkpoints" / a.checkpoint, a.resumed / "checkpoints" / a.checkpoint
    files = sorted(f for f in root_a.rglob("*") if f.suffix in (".pt", ".safetensors"))
    total = bad = 0
    for fa in files:
        fb = root_b / fa.relative_to(root_a)
        if not fb.is_file():
            print(f"  {fb} missing")
            bad += 1
            continue
        ta, tb = load(fa), load(fb)
        unequal = [k for k in ta.keys() | tb.keys()
                   if k not in ta or k not in tb or not torch.equal(ta[k], tb[k]) or ta[k].dtype != tb[k].dtype]
        total += len(ta.keys() | tb.keys())
        bad += len(unequal)
        print(f"{fa.relative_to(root_a)}: {len(ta)} tensors, {len(unequal)} differ" +
              (f" (first: {sorted(unequal)[:3]})" if unequal else ""))
    print(f"checkpoint {a.checkpoint}: {total - bad}/{total} tensors bitwise equal in {len(files)} files")
    return 0 if steps and not differ and files and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
