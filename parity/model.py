"""The K3 text forward, written once on the parity kernels; both engines call it.

A function of (weights, per-sequence caches, token ids, positions). It owns no parameters and imports
no engine: the vLLM adapter and the Megatron adapter own parameters, caches and parallelism and pass
them in. Layout: right-padded batches `[B, T]` with per-row lengths; every op is per token (linear,
norms, MoE, AttnRes) or walks a sequence in a fixed order (KDA recurrence, tiled attention), so the
kernels' invariance carries over to the whole model: a token's log-prob depends only on its sequence's
tokens up to it.

Numerics: the checkpoint's `torch_dtype` is the compute dtype (`TextConfig.compute_dtype`). In bf16 every
weight the checkpoint stores in the model dtype is rounded to bf16 (round to nearest even) where the forward
reads it (`K3Forward.weight`), so fp32 master weights and the engine's bf16 copies give the same operands;
activations are bf16 between ops, and each kernel computes in fp32 and rounds its output once. The fp32 cast
points (router logits and weights, the expert combine, KDA gate, beta, L2-normalised q/k and state, MLA output
gate, AttnRes scores, log-softmax) are listed in parity/README.md. In fp32 nothing is cast.

Quantised formats (`TextConfig.expert_format`, `latent_cache`): MXFP4 routed experts are either held packed
(`parity.quant.mxfp4.MXFP4Weight`, dequantised inside the linear kernel: the rollout engine) or as fp32 masters that
`weight` fake-quantises with the sync's quantiser, straight-through (the trainer), the same values either way. FP8 MLA
latents go through `parity.quant.fp8.round_trip` before they enter the cache, so every schedule (prefill, decode,
prefix-cache hit, trainer) attends over the values an FP8 cache holds.

Semantics follow vLLM's Kimi K3 (`vllm/models/kimi_k3/nvidia/`): AttnRes block snapshots (`attn_res`),
KDA with the full-rank gate, NoPE MLA with a sigmoid output gate, LatentMoE with SiTU and shared experts.
Kimi Linear checkpoints run the same code with those switches off (`TextConfig`): plain pre-norm residual
stream, SiLU, plain MoE, Kimi Linear's low-rank KDA output gate; tensor names come from `parity.weights`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from parity.caches import KDACache, MLACache, new_cache
from parity.config import TextConfig
from parity.experts import ExpertWeights
from parity.kernels import Kernels
from parity.kernels.linear import LoRA, k_segments
from parity.kernels.logprobs import Sampling
from parity.mla import MLAttention
from parity.kernels.primitives import wide
from parity.quant import mxfp4
from parity.quant.mxfp4 import MXFP4Weight
from parity.quant.bf16 import mark_bf16_valued
from parity.quant.ste import straight_through
from parity.weights import is_quantized, is_row_parallel, mtp_specs, packed_names, text_names, text_specs

KDA_NORM_EPS = 1e-5  # FusedRMSNormGated's default, used by vLLM's K3 KDA output norm
_ROUTING: ContextVar[list[torch.Tensor] | None] = ContextVar("zerokl_routing", default=None)


@contextmanager
def record_routing() -> Iterator[list[torch.Tensor]]:
    """Collect the experts every MoE layer chooses inside the block, from any `K3Forward` (subclasses included) in
    this context: one [*input dims, top_k] tensor of expert ids per MoE layer call, in call order, on the input's
    device (nothing is read back to the host: a CUDA graph can hold the recording).
    Recording reads the router's output only; the forward's arithmetic is unchanged."""
    log: list[torch.Tensor] = []
    token = _ROUTING.set(log)
    try:
        yield log
    finally:
        _ROUTING.reset(token)


def bf16_values(w: torch.Tensor) -> torch.Tensor:
    """`w` as the bf16 compute copy sees it: a bf16 tensor as it is; a wider master rounded to bf16 values, kept in
    its dtype with a straight-through gradient in fp32 (Megatron keeps its main grads in fp32 the same way). The kernels
    upcast bf16 operands, so both give the same bits."""
    if w.dtype == torch.bfloat16:
        return w
    return mark_bf16_valued(straight_through(w, lambda t: t.to(torch.bfloat16).to(t.dtype)))


@dataclass
class K3Weights:
    """Compute copies of the official tensors (names from `parity.weights`; fp32-stored ones in fp32, the rest in
    the compute dtype), plus optional LoRA terms keyed by the base weight's name."""

    cfg: TextConfig
    tensors: dict[str, torch.Tensor | MXFP4Weight]
    lora: dict[str, LoRA] = field(default_factory=dict)

    @classmethod
    def from_official(cls, cfg: TextConfig, weights: dict[str, torch.Tensor]) -> K3Weights:
        """Cast every text tensor once (fp32-stored ones to fp32, the rest to the compute dtype); a quantised weight
        stored packed (`parity.weights.stored_specs`) is held as an `MXFP4Weight`. Fails naming the first missing tensor."""
        tensors: dict[str, torch.Tensor | MXFP4Weight] = {}
        for name, spec in text_specs(cfg).items():
            packed, scale = packed_names(name)
            if name in weights:  # a quantised weight given unpacked is a master: fp32, fake-quantised in the forward
                wide_kept = spec.fp32 or is_quantized(cfg, name)
                tensors[name] = weights[name].to(torch.float32 if wide_kept else cfg.compute_dtype)
            elif is_quantized(cfg, name) and packed in weights and scale in weights:
                tensors[name] = MXFP4Weight(weights[packed], weights[scale])
            else:
                raise KeyError(f"checkpoint lacks {name}")
        return cls(cfg, tensors)

    def get(self, name: str) -> torch.Tensor | MXFP4Weight:
        return self.tensors[name]


class K3Forward(MLAttention, ExpertWeights):
    """Binds weights and a kernel set; `hidden`/`logits`/`token_logprobs` run the model."""

    def __init__(self, weights: K3Weights, kernels: Kernels):
        self.w = weights
        self.cfg = weights.cfg
        self.names = text_names(weights.cfg)
        self.k = kernels
        bf16 = weights.cfg.compute_dtype == torch.bfloat16
        # Activation dtype: bf16, or in fp32 mode the weights' own dtype (fp32; float64 in gradient checks).
        self.dtype = torch.bfloat16 if bf16 else weights.get(self.names.embed).dtype
        specs = text_specs(weights.cfg) | mtp_specs(weights.cfg)
        self._to_bf16 = frozenset(n for n, s in specs.items() if not s.fp32) if bf16 else frozenset()
        self._quantized = frozenset(n for n in specs if is_quantized(weights.cfg, n))
        self._row_parallel = frozenset(n for n in specs if is_row_parallel(n))

    # --- building blocks ------------------------------------------------------------------------
    def weight(self, name: str) -> torch.Tensor | MXFP4Weight:
        """The values the forward computes with: a quantised weight as held packed (the linear kernel dequantises
        it) or, held as a master, fake-quantised with the sync's quantiser (straight-through); in bf16, model-dtype
        tensors rounded to bf16 (`bf16_values`: a bf16 copy as it is, an fp32 master rounded with an fp32 gradient);
        fp32-stored tensors and everything in fp32 as held."""
        t = self.w.get(name)
        if isinstance(t, MXFP4Weight):
            return t
        if name in self._quantized:
            return mxfp4.fake_quantize(t, name)
        return bf16_values(t) if name in self._to_bf16 else t

    def _lora(self, name: str) -> LoRA | None:
        """The LoRA term of `name`; in bf16, A and B rounded to bf16 like the base weight (`bf16_values`)."""
        lora = self.w.lora.get(name)
        if lora is None or not self._to_bf16:
            return lora
        return LoRA(bf16_values(lora.a), bf16_values(lora.b), lora.scale)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x W^T (+ LoRA) for the tensor `name`; a row-parallel projection reduces over fixed K segments (so a TP
        rank can compute its share with these bits: `parity.kernels.linear`)."""
        if name in self._row_parallel:
            return self.k.linear(x, self.weight(name), self._lora(name), segments=k_segments(x.shape[-1]))
        return self.k.linear(x, self.weight(name), self._lora(name))

    def _norm(self, x: torch.Tensor, name: str, eps: float | None = None) -> torch.Tensor:
        return self.k.rmsnorm(x, self.weight(name), self.cfg.rms_norm_eps if eps is None else eps)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.hidden_act == "situ":
            return self.k.situ_glu(gate, up, c.situ_beta or 1.0, c.situ_linear_beta)
        return self.k.silu_glu(gate, up)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """down(act(gate(x), up(x)))."""
        return self._lin(self._act(self._lin(x, f"{p}.gate_proj.weight"), self._lin(x, f"{p}.up_proj.weight")),
                         f"{p}.down_proj.weight")

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """LatentMoE: route on x, experts in latent space (down -> experts -> [norm] -> up), plus shared experts."""
        c = self.cfg
        assert c.num_experts is not None
        flat = x.reshape(-1, x.shape[-1])
        logits = self.k.linear(wide(flat), self.weight(f"{p}.gate.weight"))  # fp32 logits (vLLM's GateLinear)
        ids, weights = self.k.route(logits, self.weight(f"{p}.gate.e_score_correction_bias"), c.num_experts_per_token,
                                    c.moe_renormalize, c.routed_scaling_factor, c.router_activation)
        log = _ROUTING.get()
        if log is not None:
            log.append(ids.detach().view(*x.shape[:-1], ids.shape[-1]))
        latent = flat if c.routed_expert_hidden_size is None else self._lin(flat, f"{p}.routed_expert_down_proj.weight")
        routed = self._routed_experts(latent, ids, weights, p).to(latent.dtype)
        if c.routed_expert_hidden_size is not None:
            if c.latent_moe_use_norm:
                routed = self._norm(routed, f"{p}.routed_expert_norm.weight")
            routed = self._lin(routed, f"{p}.routed_expert_up_proj.weight")
        if c.num_shared_experts:
            routed = routed + self._mlp(flat, f"{p}.shared_experts")
        return routed.view(x.shape)

    def _kda(self, x: torch.Tensor, p: str, cache: KDACache, lens: torch.Tensor) -> torch.Tensor:
        """KDA layer on normalised input x: [B, T, D]; updates `cache` in place."""
        c = self.cfg
        b, t, _ = x.shape
        h, d = c.kda_num_heads, c.kda_head_dim
        proj = torch.cat([self._lin(x, f"{p}.{n}_proj.weight") for n in ("q", "k", "v")], dim=-1)  # [B, T, 3P]
        conv_w = torch.cat([self.weight(f"{p}.{n}_conv1d.weight").squeeze(1) for n in ("q", "k", "v")])  # [3P, W]
        conv_out, _ = self.k.short_conv(proj, conv_w, cache.conv)
        window = torch.cat([cache.conv, proj], dim=1)  # last W-1 valid inputs start at lens[b]
        idx = lens.view(b, 1, 1) + torch.arange(c.conv_kernel - 1).view(1, -1, 1)
        cache.conv = window.gather(1, idx.expand(b, c.conv_kernel - 1, window.shape[-1]))
        q, k, v = conv_out.view(b, t, 3, h, d).unbind(2)
        q, k = self.k.l2norm(wide(q)), self.k.l2norm(wide(k))  # fp32, as inside vLLM's KDA kernel
        f = self._lin(self._lin(x, f"{p}.f_a_proj.weight"), f"{p}.f_b_proj.weight").view(b, t, h, d)
        a_log = self.weight(f"{p}.A_log").view(h)  # K3 stores [H], Kimi Linear [1, 1, H, 1]
        g = self.k.kda_gate(f, a_log, self.weight(f"{p}.dt_bias").view(h, d), c.gate_lower_bound)  # fp32
        beta = self.k.sigmoid(wide(self._lin(x, f"{p}.b_proj.weight")))  # [B, T, H] fp32
        valid = torch.arange(t).view(1, t) < lens.view(b, 1)
        if cache.trail is None:
            o, cache.state = self.k.kda(q, k, v, g, beta, d**-0.5, cache.state, valid)
        else:  # token by token, keeping the conv window and state after each (the recurrence's own order)
            outs = []
            for j in range(t):
                one = slice(j, j + 1)
                o_j, cache.state = self.k.kda(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], d**-0.5,
                                              cache.state, valid[:, one])
                outs.append(o_j)
                cache.trail.append((window[:, j + 1 : j + c.conv_kernel], cache.state))
            o = torch.cat(outs, dim=1)
        if c.use_full_rank_gate:
            gate = self._lin(x, f"{p}.g_proj.weight").view(b, t, h, d)
        else:  # Kimi Linear's low-rank output gate
            gate = self._lin(self._lin(x, f"{p}.g_a_proj.weight"), f"{p}.g_b_proj.weight").view(b, t, h, d)
        o = self.k.gated_rmsnorm(o, gate, self.weight(f"{p}.o_norm.weight"), KDA_NORM_EPS)
        return self._lin(o.reshape(b, t, h * d), f"{p}.o_proj.weight")

    # --- the model ------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids [B, T] -> [B, T, D] (a row copy). Hook: a vocab-parallel engine overrides it."""
        return self.weight(self.names.embed)[ids]

    def _attn_res(self, blocks: list[torch.Tensor], prefix: torch.Tensor, norm: str, proj: str,
                  out_norm: str | None) -> torch.Tensor:
        """Mix block snapshots and the current prefix (softmax over proj . rmsnorm(candidate)), then `out_norm`."""
        shape = prefix.shape
        cands = torch.stack([*blocks, prefix], dim=-2).reshape(-1, len(blocks) + 1, shape[-1])
        mixed = self.k.attn_res_mix(cands, self.weight(norm), self.weight(proj).view(-1), self.cfg.rms_norm_eps)
        mixed = mixed.view(shape)
        return mixed if out_norm is None else self._norm(mixed, out_norm)

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor,
               caches: list[KDACache | MLACache], capture: dict[str, torch.Tensor] | None = None,
               embeds: torch.Tensor | None = None, streams: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """ids, pos: [B, T] (right-padded; padded positions may hold anything >= 0), lens: [B]
        -> final hidden state before the final norm: [B, T, D] in `self.dtype`. `capture` receives each block's output.
        `streams`: for each layer index it holds, the stream after that layer is stored there (the residual stream;
        with AttnRes the current block's partial sum): what vLLM's K3 hands a DSpark draft as the hidden state after
        layer i.
        `embeds` [B, T, D]: the input rows to use instead of `embed(ids)` (a prompt's image rows merged in,
        `parity.vision.ImageRows`)."""
        c = self.cfg
        x = self.embed(ids) if embeds is None else embeds
        x = x.to(self.dtype)  # an engine's own embedding (vocab-parallel) may hold fp32 masters
        if capture is not None:
            capture["embed"] = x
        use_res = c.attn_res_block_size is not None
        blocks: list[torch.Tensor] = []
        prefix, delta = x, None
        for layer in range(c.num_hidden_layers):
            p = self.names.layer(layer)
            if use_res:
                bs = c.attn_res_block_size
                assert bs is not None
                if delta is not None:
                    prefix = prefix + delta
                if layer % bs == 0:
                    blocks.append(prefix)
                h_in = self._attn_res(blocks[: -(-layer // bs)], prefix, f"{p}.self_attention_res_norm.weight",
                                      f"{p}.self_attention_res_proj.weight", f"{p}.input_layernorm.weight")
            else:
                if delta is not None:
                    prefix = prefix + delta
                h_in = self._norm(prefix, f"{p}.input_layernorm.weight")
            cache = caches[layer]
            if isinstance(cache, KDACache):
                attn = self._kda(h_in, f"{p}.self_attn", cache, lens)
            else:
                attn = self._mla(h_in, f"{p}.self_attn", cache, pos, lens)
            if capture is not None:
                capture[f"layer{layer}.attn"] = attn
            if use_res:
                bs = c.attn_res_block_size
                assert bs is not None
                prefix = attn if layer % bs == 0 else prefix + attn
                n_blocks = -(-layer // bs) + (layer % bs == 0)
                h_mlp = self._attn_res(blocks[:n_blocks], prefix, f"{p}.mlp_res_norm.weight", f"{p}.mlp_res_proj.weight",
                                       f"{p}.post_attention_layernorm.weight")
            else:
                prefix = prefix + attn
                h_mlp = self._norm(prefix, f"{p}.post_attention_layernorm.weight")
            delta = self._moe(h_mlp, f"{p}.block_sparse_moe") if c.is_moe(layer) else self._mlp(h_mlp, f"{p}.mlp")
            if capture is not None:
                capture[f"layer{layer}.mlp"] = delta
            if streams is not None and layer in streams:
                streams[layer] = prefix + delta  # the next layer's own sum, so its bits
        assert delta is not None
        prefix = prefix + delta
        if use_res:
            prefix = self._attn_res(blocks, prefix, self.names.output_res_norm, self.names.output_res_proj, None)
        if capture is not None:
            capture["final"] = prefix
        return prefix

    # --- MTP draft layers (`parity.weights.mtp_specs`) -----------------------------------------
    def mtp_hidden(self, k: int, ids: torch.Tensor, pos: torch.Tensor, prev: torch.Tensor, lens: torch.Tensor,
                   cache: MLACache) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP draft layer `k` (vLLM's `kimi_k3_mtp`): ids, pos [B, T] the tokens to draft from and their positions,
        prev [B, T, D] the hidden state (before the final norm) that predicted each of them: the target's, or the
        previous draft step's -> (the normalised hidden state the draft logits read, the hidden state fed to the next
        draft step), both [B, T, D]. The embedding and hidden state are each RMS-normalised, concatenated and
        projected (`eh_proj`; the embedding is zero at position 0), then one plain pre-norm decoder block (MLA over
        `cache`, the layer's own latents; MoE or MLP) without Attention Residuals."""
        c = self.cfg
        layer = c.num_hidden_layers + k
        p = self.names.layer(layer)
        e = self.embed(ids).to(self.dtype)
        e = torch.where((pos == 0).unsqueeze(-1), 0.0, e)
        both = torch.cat([self._norm(e, f"{p}.enorm.weight"), self._norm(prev.to(self.dtype), f"{p}.hnorm.weight")],
                         dim=-1)
        x = self._lin(both, f"{p}.eh_proj.weight")
        x = x + self._mla(self._norm(x, f"{p}.input_layernorm.weight"), f"{p}.self_attn", cache, pos, lens)
        h = self._norm(x, f"{p}.post_attention_layernorm.weight")
        x = x + (self._moe(h, f"{p}.block_sparse_moe") if c.is_moe(layer) else self._mlp(h, f"{p}.mlp"))
        return self._norm(x, f"{p}.shared_head.norm.weight"), x

    def mtp_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft logits from `mtp_hidden`'s normalised state: the target's lm_head (shared, as vLLM shares it)."""
        return self._lin(normed, self.names.lm_head)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm then lm_head: [..., D] -> [..., V] in the activation dtype (log-probs upcast them)."""
        return self._lin(self._norm(hidden, self.names.norm), self.names.lm_head)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                       temperature: float | Sampling) -> torch.Tensor:
        """logits: [..., V], targets: [...] -> log_softmax(logits / temperature)[target]: [...] (a `Sampling`: under
        its truncated distribution, `parity.kernels.logprobs`)."""
        flat = logits.reshape(-1, logits.shape[-1])
        return self.k.token_logprobs(flat, targets.reshape(-1), temperature).view(targets.shape)


def score_sequences(fwd: K3Forward, seqs: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
    """Log-prob of every token after the first, each sequence scored in one pass (the trainer's schedule).

    Returns one [len - 1] fp32 tensor per sequence: entry t is log p(seq[t + 1] | seq[: t + 1])."""
    b = len(seqs)
    t = max(len(s) for s in seqs)
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs])
    pos = torch.arange(t).expand(b, t).clamp(max=(lens - 1).clamp(min=0).view(b, 1))
    hidden = fwd.hidden(ids, pos, lens, new_cache(fwd.cfg, b, fwd.dtype))
    logits = fwd.logits(hidden[:, :-1])
    lp = fwd.token_logprobs(logits, ids[:, 1:], temperature)
    return [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]


def decode_logprobs(fwd: K3Forward, prompt: list[int], completion: list[int], temperature: float = 1.0,
                    caches: list[KDACache | MLACache] | None = None) -> torch.Tensor:
    """The rollout engine's schedule for one sequence: prefill `prompt`, then feed one completion token per
    step through the caches (`caches`: empty ones for one sequence, e.g. paged MLA latents; default `new_cache`).
    Returns [len(completion)] fp32: entry j is log p(completion[j] | prompt, completion[:j])."""
    caches = new_cache(fwd.cfg, 1, fwd.dtype) if caches is None else caches
    hidden = fwd.hidden(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1),
                        torch.tensor([len(prompt)]), caches)[:, -1]
    out = [fwd.token_logprobs(fwd.logits(hidden), torch.tensor(completion[:1]), temperature)]
    for step, (token, target) in enumerate(zip(completion, completion[1:])):
        pos = torch.tensor([[len(prompt) + step]])
        hidden = fwd.hidden(torch.tensor([[token]]), pos, torch.tensor([1]), caches)[:, -1]
        out.append(fwd.token_logprobs(fwd.logits(hidden), torch.tensor([target]), temperature))
    return torch.cat(out)
