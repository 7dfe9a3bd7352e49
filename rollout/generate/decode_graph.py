"""A batched decode step of the rollout model code captured in a CUDA graph, as vLLM captures its decode batches.

`GraphedDecode(fwd, caches)` records one step, `K3Forward.hidden` of one token per row then `logits`, over the
caches' current buffers; `step(tokens, positions)` replays it. The step's new KDA and conv states are copied into the
buffers the graph reads (the paged latent pool and its lengths are written in place by the step itself), so after each
replay the caches hold the state of decoding that token eagerly, and eager calls may follow. The kernels are the same
launches as eagerly, so a replay gives the eager step's bits (a GPU test checks it; `bench/ppo_gpu.py` runs it and the
trainer's log-prob check covers every step).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import torch

from parity.caches import KDACache, MLACache
from parity.model import K3Forward
from rollout.generate.paged_pool import PagedLatentPool


def _state_tensors(caches: list) -> list[torch.Tensor]:
    """Every tensor the decode step reads and writes back (KDA conv and state, a chunk state's fields, the pool's
    lengths); the pool's blocks are written only past each row's length, so they need no restoring."""
    out: list[torch.Tensor] = []
    for c in caches:
        if isinstance(c, KDACache):
            out.append(c.conv)
            out.extend([getattr(c.state, f.name) for f in fields(c.state)] if is_dataclass(c.state) else [c.state])
        elif isinstance(c, PagedLatentPool):
            out.append(c.length)
        elif isinstance(c, MLACache):
            raise TypeError("a captured decode step needs the paged latent pool (a contiguous cache grows)")
    return out


class GraphedDecode:
    """One decode step for `len(positions)` rows over `caches` (after their prefill), replayable."""

    def __init__(self, fwd: K3Forward, caches: list, batch: int) -> None:
        self.fwd, self.caches = fwd, caches
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.lens = torch.ones(batch, dtype=torch.long, device="cuda")
        self.buffers = [c.state for c in caches if isinstance(c, KDACache)]  # the objects the graph reads
        self.convs = [c.conv for c in caches if isinstance(c, KDACache)]
        saved = [t.clone() for t in _state_tensors(caches)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # first use compiles and tunes the kernels: never inside the capture
            self._run()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(_state_tensors(caches), saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def _run(self) -> torch.Tensor:
        """The step, then every KDA cache's new conv window and state copied into the buffers read at its start."""
        h = self.fwd.hidden(self.tokens, self.positions, self.lens, self.caches)[:, 0]
        logits = self.fwd.logits(h)
        kda = [c for c in self.caches if isinstance(c, KDACache)]
        for c, conv, state in zip(kda, self.convs, self.buffers):
            conv.copy_(c.conv)
            if is_dataclass(state):
                for f in fields(state):
                    getattr(state, f.name).copy_(getattr(c.state, f.name))
            else:
                state.copy_(c.state)
            c.conv, c.state = conv, state
        return logits

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: [B, 1] -> logits [B, V] (the graph's output buffer: overwritten by the next step)."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits
