"""zerokl's K3 with its vision tower as a vLLM multimodal model: vLLM parses, preprocesses, hashes and caches images;
`parity.vision` computes their embeddings.

`ZeroKLK3ForConditionalGeneration` is `ZeroKLK3ForCausalLM` plus vLLM's multimodal interface, registered with vLLM's
own K3 processor (`vllm/models/kimi_k3/common/mm_preprocess.py`: each `<|kimi_image_placeholder|>` of a prompt becomes
`<|media_begin|>image WxH<|media_content|>` + one pad per merged patch + `<|media_end|>`, the pad being the config's
`media_placeholder_token_id`, in zerokl's tokenizer the placeholder token itself; its pixels come from
`KimiK25FusedVisionProcessor`, equal bit for bit to `parity.image`'s). vLLM runs `embed_multimodal` once per image
(the encoder cache keeps the result across chunked-prefill steps), scatters the rows into the prompt's pad positions (`embed_input_ids`), and hands the step's rows to `forward` as `inputs_embeds`; the prefix cache keys each
block by the images' hashes. Each image runs alone through the tower on the parity kernels, so its rows are the bits
the trainer computes for it (`trainer.logprobs.PaddedBatch.images`).

Where the tower's tensors live follows the trainer: frozen (the default), they are held outside the module's
parameters, so weight syncs (which carry the parameters) neither send nor expect them; served `zerokl_vision_synced`
(`rollout.vllm.plugin.hf_overrides(vision_synced=True)`, a run that trains the tower), they are parameters under their
official names in the compute dtype, and every full sync carries them with the text weights (the tower reads the
parameters themselves, so a sync rewrites it in place).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from parity.image import IMAGE_PLACEHOLDER, ImageProcessing
from parity.io.vision import vision_specs
from parity.vision import ImagePatches, TowerShape, VisionTower
from parity.weights import parameter_tree
from rollout.vllm.plugin import VISION_SYNCED_KEY
from rollout.vllm.model import ModelSetupError, ZeroKLK3ForCausalLM, checkpoint_config
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.models.kimi_k3.common.mm_preprocess import (KimiK3DummyInputsBuilder, KimiK3MultiModalProcessor,
                                                      KimiK3ProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY


@MULTIMODAL_REGISTRY.register_processor(KimiK3MultiModalProcessor, info=KimiK3ProcessingInfo,
                                        dummy_inputs=KimiK3DummyInputsBuilder)
class ZeroKLK3ForConditionalGeneration(ZeroKLK3ForCausalLM, SupportsMultiModal):
    """K3 text model + vision tower on the parity kernels, images through vLLM's multimodal path."""

    requires_raw_input_tokens: ClassVar[bool] = True  # `forward` takes the ids (step grouping, LoRA rows) and the rows

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality == "image":
            return IMAGE_PLACEHOLDER
        raise ValueError(f"zerokl's K3 takes images only, not {modality}")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.model_cfg = checkpoint_config(vllm_config)
        if self.model_cfg.vision is None:
            raise ModelSetupError("this checkpoint has no vision_config: serve it as a text model")
        self.processing = ImageProcessing.from_checkpoint(vllm_config.model_config.model)
        specs = vision_specs(self.model_cfg.vision, self.cfg.hidden_size)
        self.vision_names = frozenset(specs)
        shapes = {n: (spec.shape, self.cfg.compute_dtype) for n, spec in specs.items()}
        self.vision_synced = bool(getattr(vllm_config.model_config.hf_config, VISION_SYNCED_KEY, False))
        if self.vision_synced:
            for name, child in parameter_tree(shapes).named_children():
                self.add_module(name, child)
            params = dict(self.named_parameters())
            weights = {n: params[n] for n in specs}
        else:
            weights = {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
        self.tower = VisionTower(TowerShape.from_config(self.model_cfg.vision, self.processing.side_limit), weights,
                                 self.kernels, self.cfg.compute_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text tensors as `ZeroKLK3ForCausalLM.load_weights` loads them; the vision tensors into the tower, cast
        to the compute dtype."""
        held: set[str] = set()

        def text_only() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in self.vision_names:
                    target = self.tower.w[name]
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ModelSetupError(f"{name}: checkpoint shape {tuple(tensor.shape)}, config says "
                                              f"{tuple(target.shape)}")
                    with torch.no_grad():
                        target.copy_(tensor.to(target.dtype))
                    held.add(name)
                else:
                    yield name, tensor

        loaded = super().load_weights(text_only())
        missing = sorted(self.vision_names - held)
        if missing:
            raise ModelSetupError(f"checkpoint lacks {len(missing)} vision tensors, first: {missing[0]}")
        return loaded | held

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        """pixel_values [patches of every image, 3, p, p], grid_thws [images, 3] -> one [tokens, D] per image, each
        image alone through the tower."""
        pixels, grids = kwargs.get("pixel_values"), kwargs.get("grid_thws")
        if pixels is None:
            return []
        if isinstance(pixels, list):
            pixels = torch.cat(pixels)
        assert isinstance(pixels, torch.Tensor) and isinstance(grids, torch.Tensor)
        merge = self.tower.shape.merge
        out, start = [], 0
        for t, h, w in grids.reshape(-1, 3).tolist():
            n = t * h * w
            out.append(self.tower(ImagePatches(pixels[start : start + n], (t, h, w), merge)))
            start += n
        return out

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: object = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [N, D], the rows marked `is_multimodal` replaced in order by the images' rows."""
        embeds = self.fwd.embed(input_ids)
        if multimodal_embeddings is None or is_multimodal is None or not bool(is_multimodal.any()):
            return embeds
        rows = torch.cat(list(multimodal_embeddings)) if not isinstance(multimodal_embeddings, torch.Tensor) \
            else multimodal_embeddings.reshape(-1, embeds.shape[-1])
        embeds = embeds.clone()
        embeds[is_multimodal] = rows.to(embeds.dtype)
        return embeds
