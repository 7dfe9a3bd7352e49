"""Float64 reference of the Kimi K3 text forward for one sequence: the spec the fast paths are checked against.

Follows vLLM's `KimiLinearModel.forward` / `KimiDecoderLayer` / `KimiLinearForCausalLM.compute_logits`:

    x = embed(tokens); AttnRes stream from x
    per layer i: h = attn(AttnRes_attn(i)) (KDA or MLA); m = mlp(AttnRes_mlp(i, h)) (dense GLU or LatentMoE)
    logits = lm_head(RMSNorm_norm(AttnRes_output))

Without `attn_res_block_size` (Kimi Linear) the AttnRes stream is the plain pre-norm residual stream
(`parity.reference.residual`); the other K3 switches are read by the blocks themselves.

Plain and slow on purpose: per-token loops in KDA and MLA, no cache, no batching. Never on a hot path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from parity.config import TextConfig
from parity.reference.attn_res import AttnResStream
from parity.reference.kda import kda_layer
from parity.reference.mla import mla_layer
from parity.reference.moe import moe_layer
from parity.reference.ops import gated_mlp, glu_activation, linear, rms_norm
from parity.reference.residual import ResidualStream
from parity.weights import is_mtp, text_names, text_specs
from parity.io.checkpoint import load_checkpoint


class ReferenceWeightsError(ValueError):
    """Weights that do not match the config's text tensor table; the message names the tensor."""


def _relative(weights: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors under `prefix`, keyed by the rest of their name."""
    return {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}


class ReferenceK3:
    """Float64 K3 / Kimi Linear text model for one unbatched sequence; holds float64 copies of every text tensor."""

    def __init__(self, cfg: TextConfig, weights: Mapping[str, Tensor]) -> None:
        """Check `weights` against `parity.weights.text_specs(cfg)` and copy them to float64.

        Tensors outside the text model (K3: outside `language_model.`, the vision tower) and the MTP draft layers
        are ignored; a missing,
        misshapen or unexpected text tensor raises ReferenceWeightsError naming it.
        """
        specs, names = text_specs(cfg), text_names(cfg)
        for name, spec in specs.items():
            if name not in weights:
                raise ReferenceWeightsError(f"missing text tensor {name}")
            if tuple(weights[name].shape) != spec.shape:
                raise ReferenceWeightsError(f"{name} has shape {tuple(weights[name].shape)}, config says {spec.shape}")
        extra = sorted(n for n in weights if n.startswith(names.root) and n not in specs and not is_mtp(cfg, n))
        if extra:
            raise ReferenceWeightsError(f"{len(extra)} unexpected text tensors, first: {extra[0]}")
        self.cfg = cfg
        self.names = names
        self.weights = {name: weights[name].detach().to(torch.float64) for name in specs}
        self.layers = [_relative(self.weights, f"{names.layer(i)}.") for i in range(cfg.num_hidden_layers)]
        self.act = glu_activation(cfg)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ReferenceK3:
        """Load an official-format checkpoint directory (`parity.io.checkpoint.load_checkpoint`)."""
        cfg, weights = load_checkpoint(path)
        return cls(cfg.text, weights)

    def _attention(self, layer: int, x: Tensor) -> Tensor:
        """KDA or MLA block of `layer`.  x: [T, D] f64 -> [T, D] f64."""
        w = _relative(self.layers[layer], "self_attn.")
        return kda_layer(x, w, self.cfg) if self.cfg.is_kda(layer) else mla_layer(x, w, self.cfg)

    def _mlp(self, layer: int, x: Tensor) -> Tensor:
        """LatentMoE or dense GLU block of `layer`.  x: [T, D] f64 -> [T, D] f64."""
        if self.cfg.is_moe(layer):
            return moe_layer(x, _relative(self.layers[layer], "block_sparse_moe."), self.cfg, self.act)
        w = _relative(self.layers[layer], "mlp.")
        return gated_mlp(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"], self.act)

    def hidden_states(self, token_ids: Tensor) -> dict[str, Tensor]:
        """Every intermediate of one forward, for diagnosis, all [T, D] f64 except logits [T, V] f64.

        Keys: "embed"; per layer i "layer{i}.attn_in" (normed AttnRes mix fed to attention), "layer{i}.attn"
        (attention output), "layer{i}.mlp_in", "layer{i}.mlp", and without AttnRes "layer{i}.out" (the residual
        stream after the layer); "final" (what vLLM's model forward returns: the AttnRes output, or the last
        residual), "final_norm" (after `norm`), "logits".
        token_ids: [T] int64.
        """
        cfg, w, names = self.cfg, self.weights, self.names
        x = w[names.embed][token_ids]
        states = {"embed": x}
        if cfg.attn_res_block_size is None:
            final = self._plain_layers(x, states)
        else:
            final = self._attn_res_layers(x, states)
        final_norm = rms_norm(final, w[names.norm], cfg.rms_norm_eps)
        states.update({"final": final, "final_norm": final_norm, "logits": linear(final_norm, w[names.lm_head])})
        return states

    def _attn_res_layers(self, x: Tensor, states: dict[str, Tensor]) -> Tensor:
        """Every decoder layer on the AttnRes stream from embedding x; fills `states`; returns the output mix."""
        cfg, w = self.cfg, self.weights
        assert cfg.attn_res_block_size is not None
        stream = AttnResStream(x, cfg.attn_res_block_size, cfg.num_attn_res_blocks, cfg.rms_norm_eps)
        for i, p in enumerate(self.layers):
            h = stream.before_attn(i, p["self_attention_res_norm.weight"], p["self_attention_res_proj.weight"][0],
                                   p["input_layernorm.weight"])
            a = self._attention(i, h)
            h2 = stream.before_mlp(i, a, p["mlp_res_norm.weight"], p["mlp_res_proj.weight"][0],
                                   p["post_attention_layernorm.weight"])
            m = self._mlp(i, h2)
            stream.after_mlp(m)
            states.update({f"layer{i}.attn_in": h, f"layer{i}.attn": a, f"layer{i}.mlp_in": h2, f"layer{i}.mlp": m})
        return stream.output(w[self.names.output_res_norm], w[self.names.output_res_proj][0])

    def _plain_layers(self, x: Tensor, states: dict[str, Tensor]) -> Tensor:
        """Every decoder layer on the plain residual stream from embedding x; fills `states`; returns the stream."""
        stream = ResidualStream(x, self.cfg.rms_norm_eps)
        for i, p in enumerate(self.layers):
            h = stream.before_attn(p["input_layernorm.weight"])
            a = self._attention(i, h)
            h2 = stream.before_mlp(a, p["post_attention_layernorm.weight"])
            m = self._mlp(i, h2)
            out = stream.after_mlp(m)
            states.update({f"layer{i}.attn_in": h, f"layer{i}.attn": a, f"layer{i}.mlp_in": h2, f"layer{i}.mlp": m,
                           f"layer{i}.out": out})
        return stream.output()

    def forward(self, token_ids: Tensor) -> Tensor:
        """Logits of every position.  token_ids: [T] int64 -> [T, V] f64."""
        return self.hidden_states(token_ids)["logits"]

    def logprobs(self, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """lp[t] = log_softmax(logits[t] / temperature)[token_ids[t + 1]], t = 0..T-2.

        token_ids: [T] int64 -> [T - 1] f64.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        lp = torch.log_softmax(self.forward(token_ids)[:-1] / temperature, dim=-1)
        return lp.gather(1, token_ids[1:, None])[:, 0]
