"""vLLM LoRA on zerokl's K3 model: vLLM manages adapters, zerokl reads and computes them.

vLLM keeps the adapter lifecycle: `enable_lora`, `max_loras` slots, `max_lora_rank`, `LoRARequest` per
request, LRU eviction, the runtime `/v1/load_lora_adapter` endpoints, and the per-token slot mapping of each
step (`token_lora_indices`, -1 for a request without LoRA). zerokl keeps the numbers: when vLLM loads an
adapter for an id, the adapter directory is read a second time with `lora.adapter.load_adapter` (the same
reader, validation and fp32 tensors as the trainer's), and each request's tokens run through
`parity.model.K3Forward` with that adapter in `K3Weights.lora`. vLLM's own LoRA layers and punica ops are never
used (the model has no vLLM linear layers), so none of their batch-composition behaviour applies: requests
are grouped by adapter and each group runs the shared forward, whose rows do not depend on the group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lora.adapter import load_lora
from lora.spec import AdapterError
from parity.kernels import Kernels
from parity.kernels.linear import LoRA
from parity.model import K3Forward, K3Weights

LANGUAGE_WRAPPER_KEY = "language_model"  # vllm.lora.model_manager.DEFAULT_LANGUAGE_WRAPPER_KEY


class AdapterTable:
    """Adapters by vLLM's `lora_int_id`, each with its K3 forward over the shared base tensors.

    Invariant: an id maps to the tensors read from the directory vLLM was last asked to load for that id;
    ids vLLM no longer holds are dropped on the next load."""

    def __init__(self, base: K3Forward, kernels: Kernels):
        self.base = base
        self.kernels = kernels
        self._adapters: dict[int, tuple[Path, dict[str, LoRA]]] = {}
        self._forwards: dict[int, K3Forward] = {}

    def load(self, lora_id: int, path: str | Path, registered: set[int]) -> None:
        """Read and validate the adapter at `path` for `lora_id` (raises `AdapterError`, naming the problem);
        forget ids not in `registered` (vLLM's currently loaded ids)."""
        for stale in set(self._adapters) - registered - {lora_id}:
            del self._adapters[stale]
            self._forwards.pop(stale, None)
        resolved = Path(path).expanduser().resolve()
        lora = load_lora(resolved, self.base.cfg)
        self._adapters[lora_id] = (resolved, lora)
        self._forwards[lora_id] = K3Forward(K3Weights(self.base.cfg, self.base.w.tensors, lora), self.kernels)

    def forward(self, lora_id: int) -> K3Forward:
        """The forward for requests of `lora_id` (0: no adapter)."""
        if lora_id == 0:
            return self.base
        if lora_id not in self._forwards:
            raise AdapterError(f"LoRA id {lora_id} is active in vLLM but was not read by zerokl's adapter loader")
        return self._forwards[lora_id]

    def row_ids(self, manager: Any, first_token: torch.Tensor) -> torch.Tensor:
        """vLLM's adapter id of each row whose first flat token index is `first_token` (0: no adapter)."""
        if manager is None:
            return torch.zeros_like(first_token)
        slots = manager.punica_wrapper_mapping[LANGUAGE_WRAPPER_KEY].token_lora_indices[first_token]
        ids = [0 if s < 0 else manager.lora_index_to_id[s] for s in slots.tolist()]
        return torch.tensor(ids, dtype=torch.long, device=first_token.device)
