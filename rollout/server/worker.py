"""What `zerokl serve` adds to vLLM's worker class (`--worker-extension-cls rollout.server.worker.ServerWorker`):
methods its server routes (`rollout.server.admin`) reach through `collective_rpc`.

- `zerokl_weights`: the version of the weights the worker computes with and their checksum, computed from the live
  parameters (`parity.sync.bundle.weights_checksum` of each parameter's `checksum`): the same value the trainer computes
  for the bundle it sent, so equal checksums mean the server serves the trainer's bits.
- `zerokl_abort_weight_update`: drop a staged update and end the update session without touching the weights (another
  server of the same sync rejected its copy: every server stays on its version).
- `zerokl_rollback_weight_update` / `zerokl_confirm_weight_update`: undo a committed update (another server of the
  same sync could not commit its copy) or keep it (every server committed), `rollout.vllm.weight_transfer`.
- `zerokl_records_start` / `zerokl_records_take`: the raw log-probs and expert choices of requests whose id carries
  `RECORD_MARK` (`rollout.vllm.records`), recorded from the first call on, handed out (and forgotten) per request.
"""

from __future__ import annotations

from typing import Any

from parity.sync.bundle import checksum, weights_checksum
from rollout.vllm import records
from rollout.server.admin import RECORD_MARK


def record_key(request_id: str) -> str | None:
    """The client's id inside a worker's request id (vLLM prefixes its route's name and appends a random suffix)."""
    external = records.external_id(request_id)
    at = external.find(RECORD_MARK)
    return external[at:] if at >= 0 else None


class ServerWorker:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def zerokl_weights(self) -> dict[str, Any]:
        engine = self.weight_transfer_engine
        params = dict(self.model_runner.get_model().named_parameters())
        return {"version": engine.version, "checksum": weights_checksum({n: checksum(p) for n, p in params.items()}),
                "vision_synced": bool(getattr(self.model_runner.get_model(), "vision_synced", False))}

    def zerokl_abort_weight_update(self) -> None:
        self.weight_transfer_engine.abort_weight_update()
        if self._weight_update_active:
            self.finish_weight_update()  # nothing staged: the weights stay; ends the worker's update session

    def zerokl_rollback_weight_update(self) -> None:
        self.weight_transfer_engine.rollback_weight_update()

    def zerokl_confirm_weight_update(self) -> None:
        self.weight_transfer_engine.confirm_weight_update()

    def zerokl_records_start(self) -> None:
        if getattr(self.model_runner.get_model(), "records", None) is None:
            records.start(self, keep=lambda request: record_key(request) is not None)

    def zerokl_records_take(self, request_ids: list[str]) -> dict[str, dict[str, list]]:
        """{client id: {"raw": [...], "routing": [...]}} for each asked id that was recorded, as JSON lists (a position
        with no raw log-prob, NaN in `rollout.vllm.records`, is null)."""
        held = self.model_runner.get_model().records
        if held is None:
            return {}
        wanted = set(request_ids)
        taken = held.pop(lambda request: record_key(request) in wanted)
        return {record_key(r): {k: _json_list(v) for k, v in t.items()} for r, t in taken.items()}


def _json_list(t: Any) -> list:
    values = t.tolist()
    return [None if v != v else v for v in values] if t.is_floating_point() else values
