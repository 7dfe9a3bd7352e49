"""vLLM attention backends for zerokl's K3 layers: per-step metadata only; the compute is `parity.model`.

Two backends, one per vLLM cache kind:

- `latent_backend(L, dtype)`: MLA latents in vLLM's paged KV cache, declared as a `FullAttentionSpec` with
  one head of size L and no V half (one latent per token, in the compute dtype). It accepts any block size (`MultipleOf(1)`), so
  the hybrid block alignment vLLM derives from the state page size is always accepted (CPU_MLA takes
  16 only, which is why vLLM's own MLA layer cannot run this hybrid on CPU). `customize_spec` turns the
  generic attention spec vLLM uses for that alignment into the latent spec, so the alignment computes
  with the page the layers really allocate, whatever the config's `head_dim` / `num_key_value_heads` say.
- `KDAStateBackend`: KDA conv + recurrent state in vLLM's hybrid state cache (`MambaSpec`), one state
  slot per request: the block holding the request's last token in `align` (prefix caching) mode, the
  request's only block otherwise (`mamba_get_block_table_tensor`).

Invariant: metadata holds only per-request indices and lengths; nothing in it depends on batch shape
beyond which rows exist, so a request's cache reads and writes are the same in any batch. Its tensors are views of
the model runner's persistent buffers, never new tensors: everything derived from them is computed inside the model's
forward, so a CUDA graph of a decode step (vLLM's FULL_DECODE_ONLY mode: `UNIFORM_SINGLE_TOKEN_DECODE` below) reads
each replay's values. Each build is also left on the group's layers (`step_metadata`), where the worker's records
read the layout of the step they sample from (`rollout.vllm.records`): a replayed forward runs no Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec

@dataclass(frozen=True)
class StepLayout:
    """Where each request's tokens sit in this step's flat token list: views of the runner's buffers on the engine's
    device, one row per request (in a padded CUDA-graph batch the padding requests have no tokens and length 0)."""

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens_view: torch.Tensor  # [R] int32: tokens of the request after this step
    uniform_decode: bool  # every request has exactly one query token (and the step as many tokens as requests)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_view.shape[0]

    @property
    def query_start(self) -> torch.Tensor:
        """[R + 1] int64."""
        return self.query_start_loc.long()

    @property
    def seq_lens(self) -> torch.Tensor:
        """[R] int64."""
        return self.seq_lens_view.long()

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start[1:] - self.query_start[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """Tokens already in the caches before this step."""
        return self.seq_lens - self.query_lens

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> StepLayout:
        r = common.num_reqs
        return cls(common.query_start_loc[: r + 1], common.seq_lens[:r], common.max_query_len == 1)


def _leave_on_layers(builder: AttentionMetadataBuilder, meta: object) -> None:
    """Set `step_metadata` = this build's metadata on the builder's layers (named in vLLM's static forward context)."""
    layers = builder.vllm_config.compilation_config.static_forward_context
    for name in builder.layer_names:
        layers[name].step_metadata = meta


@dataclass(frozen=True)
class LatentMetadata:
    """Per-step metadata of the latent (MLA) cache group."""

    layout: StepLayout
    block_table: torch.Tensor  # [R, max_blocks] int
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot of each token (block * block_size + offset), -1: none


@dataclass(frozen=True)
class KDAStateMetadata:
    """Per-step metadata of the KDA state group."""

    layout: StepLayout
    block_table: torch.Tensor  # [R, blocks] int: the request's state blocks
    block_size: int | None  # align mode (prefix caching): tokens per state block; None: one slot per request

    @property
    def state_index(self) -> torch.Tensor:
        """[R] int64: the state slot each request reads and writes this step: its only block, or in align mode the
        block holding its last token (vLLM's `mamba_get_block_table_tensor`; padding requests get block 0, the null
        block)."""
        if self.block_size is None:
            return self.block_table[:, 0].long()
        last = ((self.layout.seq_lens - 1) // self.block_size).clamp(min=0)
        return self.block_table.long().gather(1, last.view(-1, 1)).view(-1)


class _StateOnlyImpl(AttentionImplBase):
    """The attention 'impl' of a cache-only backend: the compute is the layer's own; nothing to run here."""

    supports_pcp = False
    supports_dcp = False


class LatentMetadataBuilder(AttentionMetadataBuilder[LatentMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LatentMetadata:
        c = common_attn_metadata
        meta = LatentMetadata(StepLayout.from_common(c), c.block_table_tensor[: c.num_reqs],
                              c.slot_mapping[: c.num_actual_tokens])
        _leave_on_layers(self, meta)
        return meta


class _LatentBackendBase(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float32", "bfloat16"]
    latent_size: ClassVar[int]
    cache_dtype: ClassVar[torch.dtype]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return _StateOnlyImpl

    @staticmethod
    def get_builder_cls() -> type[LatentMetadataBuilder]:
        return LatentMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One latent of `latent_size` values per token in `cache_dtype` (exactly what the forward produced), no V half."""
        return FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=cls.latent_size,
                                 head_size_v=0, dtype=cls.cache_dtype, page_size_padded=spec.page_size_padded)


@cache
def latent_backend(latent_size: int, dtype: torch.dtype) -> type[AttentionBackend]:
    """The latent-cache backend for latents of `latent_size` values stored in `dtype` (one class per size and dtype,
    like vLLM's dynamically built local-attention backends; cached so every layer shares it)."""
    tag = f"{latent_size}_{str(dtype).removeprefix('torch.')}"
    name = f"ZeroKLLatentBackend_{tag}"
    return type(name, (_LatentBackendBase,), {
        "latent_size": latent_size,
        "cache_dtype": dtype,
        "__qualname__": name,
        "get_name": staticmethod(lambda: f"ZEROKL_LATENT_{tag.upper()}"),
    })


class KDAStateMetadataBuilder(AttentionMetadataBuilder[KDAStateMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        assert isinstance(kv_cache_spec, MambaSpec)
        self.mode = vllm_config.cache_config.mamba_cache_mode

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KDAStateMetadata:
        c = common_attn_metadata
        block_size = None if self.mode == "none" else self.kv_cache_spec.block_size
        meta = KDAStateMetadata(StepLayout.from_common(c), c.block_table_tensor[: c.num_reqs], block_size)
        _leave_on_layers(self, meta)
        return meta


class KDAStateBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "ZEROKL_KDA_STATE"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return _StateOnlyImpl

    @staticmethod
    def get_builder_cls() -> type[KDAStateMetadataBuilder]:
        return KDAStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


def latent_spec(block_size: int, latent_size: int, dtype: torch.dtype) -> AttentionSpec:
    """The spec a latent layer declares: what `latent_backend(L, dtype).customize_spec` makes of any attention spec."""
    base = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=latent_size, dtype=dtype)
    return latent_backend(latent_size, dtype).customize_spec(base)
