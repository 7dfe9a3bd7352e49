"""`RemoteRollout`: rollouts from live `zerokl serve` servers (other processes or machines) and weight sync into them,
with the same `generate` contract as the in-process `rollout.engine.RolloutEngine`.

Generation: every sample is one token-in/token-out request (`/inference/v1/generate`) with the seed the in-process
engine would give it (`sample_seed`), so a sample's tokens and log-probs depend only on (weights, prompt, seed), not on
which server runs it or what else that server batches. The samples of one prompt go to one server (its prefix cache
serves the prompt once), prompts are spread over the servers in turn. Each request carries the version its client
expects (`X-ZeroKL-Weight-Version`: a server holding another version refuses it) and each answer's tokens must carry
that version (vLLM labels every token with the weights that sampled it), so no step mixes samples of two versions.
A server that fails (connection refused or reset, HTTP 5xx) is dropped and its prompts are retried on the others:
the same seeds give the same samples there. With no server left the call raises `RolloutError`.

Weight sync (`sync`): a full-weight bundle goes to every live server, and any dropped one that answers again, all or
none, in two phases (`rollout.client.two_phase`: stage everywhere, then commit everywhere with a rollback if any live
server fails; a server that dies on the way is dropped and the others go on). A dropped server that answers again
(restarted) takes part in the next sync, which brings it to the current version, and gets no requests before it.
Adapters (LoRA runs) go through `zerokl lora push`'s protocol instead (`set_policy_adapter`, `sync` of an adapter
bundle).
"""

from __future__ import annotations

import base64
import io
import math
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity.config import TextConfig
from parity.sync.bundle import SyncError, Transport, WeightBundle
from parity.sync.transports import SyncResult
from rollout.sampling import ImagePrompt, RolloutError, Sample, check_sampling, prompt_seeds, sample_seed
from rollout.client import http
from rollout.client.http import Server, ServerDown
from rollout.client.two_phase import NO_SERVER, TwoPhaseSync
from rollout.server.admin import (GENERATE_ROUTE, RECORD_MARK, RECORDS_ROUTE, RECORDS_START_ROUTE, VERSION_HEADER,
                                  served_version)


@dataclass
class RemoteRollout:
    """Rollouts from the servers at `urls` (all serving the same checkpoint as `text_cfg` describes)."""

    urls: Sequence[str]
    text_cfg: TextConfig
    api_key: str | None = None
    log: Callable[[str], None] = print
    servers: list[Server] = field(init=False)  # live: they get requests
    dropped: list[Server] = field(init=False, default_factory=list)  # failed; rejoin at a sync once they answer
    version: int = field(init=False, default=0)
    policy_adapter: str | None = field(init=False, default=None)  # the served name requests select (LoRA runs)

    def __post_init__(self) -> None:
        if not self.urls:
            raise RolloutError("no rollout servers given")
        self.servers = [Server(u.rstrip("/"), self.api_key) for u in self.urls]
        held = {}
        for s in self.servers:
            try:
                held[s.url] = s.weights()
                s.workers = int(s.call("GET", "/get_world_size?include_dp=true")["world_size"])
                s.call("POST", RECORDS_START_ROUTE, {})
            except ServerDown as e:
                raise RolloutError(f"rollout server {s.url} is not reachable ({e}); start it with `zerokl serve`") \
                    from None
            except urllib.error.HTTPError as e:
                raise RolloutError(f"rollout server {s.url} refused zerokl's routes (HTTP {e.code}: {http.message(e)}); "
                                   "is it a `zerokl serve` server, and is --api-key right?") from None
        versions = {w["version"] for w in held.values()}
        if len(versions) != 1:
            raise RolloutError(f"the rollout servers hold different weight versions: "
                               f"{ {u: w['version'] for u, w in held.items()} }")
        self.version = versions.pop()
        self.checksums = {u: w["checksum"] for u, w in held.items()}
        self.vision_synced = {u: bool(w.get("vision_synced")) for u, w in held.items()}  # the tower takes syncs

    @property
    def policy_version(self) -> int:
        return self.version

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | ImagePrompt], n: int = 1, temperature: float = 1.0,
                 max_tokens: int = 16, seed: int | Sequence[int] = 0, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None, ignore_eos: bool = False,
                 stop_token_ids: Sequence[int] = (),
                 lora: str | None = None, record: bool = False) -> list[Sample]:
        """`RolloutEngine.generate`'s contract (token-id prompts, or `ImagePrompt`s: their images sent as PNG content
        parts, which the server decodes to the same RGB pixels); `lora`: the served adapter name every prompt uses
        (`policy_adapter`), None for the base model."""
        if any(isinstance(p, str) for p in prompts):
            raise RolloutError("rollout servers take token-id prompts")
        inputs = [_inputs(p) for p in prompts]
        seeds = prompt_seeds(prompts, seed)
        check_sampling(n, temperature, max_tokens, top_p, top_k, min_p)
        params = {"temperature": temperature, "max_tokens": max_tokens, "logprobs": 0, "ignore_eos": ignore_eos,
                  **({"stop_token_ids": list(stop_token_ids)} if stop_token_ids else {}),
                  **{k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)) if v is not None}}
        tag = uuid.uuid4().hex[:12]
        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
        results: dict[tuple[int, int], tuple[Server, dict]] = {}
        pending = list(jobs)
        while pending:
            live = self.live()
            assignment = {job: live[job[0] % len(live)] for job in pending}

            def run(job: tuple[int, int]) -> tuple[Server, dict]:
                i, j = job
                body = {"request_id": f"{RECORD_MARK}{tag}-{i}-{j}", **inputs[i],
                        "sampling_params": {**params, "seed": sample_seed(seeds[i], j)},
                        **({"model": lora} if lora is not None else {})}
                server = assignment[job]
                return server, self._request(server, body)

            with ThreadPoolExecutor(min(64, len(pending))) as pool:
                outcomes = list(zip(pending, pool.map(http.catching(run), pending)))
            pending = []
            for job, (value, error) in outcomes:
                if isinstance(error, ServerDown):
                    self._drop(assignment[job], error, "its requests retried on them")
                    pending.append(job)
                elif error is not None:
                    raise error
                else:
                    results[job] = value
        samples = [self._sample(results[(i, j)][1]) for i, j in jobs]
        if not record:
            return samples
        return self._recorded(jobs, samples, {job: results[job][0] for job in jobs}, tag)

    def live(self) -> list[Server]:
        if not self.servers:
            raise RolloutError("every rollout server has failed: with the servers up again (`zerokl serve`, or the "
                               "ones a run starts itself), resume the run from its last checkpoint (--resume)")
        return self.servers

    def _drop(self, server: Server, error: Exception, then: str = "") -> None:
        if server in self.servers:
            self.servers.remove(server)
            self.dropped.append(server)
            self.checksums.pop(server.url, None)
            self.vision_synced.pop(server.url, None)
            self.log(f"rollout server {server.url} failed ({error}); {len(self.servers)} left"
                     + (f", {then}" if then and self.servers else ""))

    def _request(self, server: Server, body: dict) -> dict:
        try:
            return server.call("POST", GENERATE_ROUTE, body, {VERSION_HEADER: str(self.version)})
        except urllib.error.HTTPError as e:
            raise RolloutError(f"rollout server {server.url} refused a request: HTTP {e.code}: {http.message(e)}") \
                from None

    def _sample(self, answer: dict) -> Sample:
        """The server's answer (`return_token_ids`: the prompt as the engine ran it, images expanded) as a `Sample`."""
        choice = answer["choices"][0]
        tokens = list(choice["token_ids"])
        versions = {span["version"] for span in choice.get("weight_versions") or ()}
        if {served_version(v) for v in versions} != {self.version}:
            raise RolloutError(f"request {answer.get('request_id')}: tokens from weight versions {sorted(versions)}, "
                               f"expected {self.version} only")
        content = choice["logprobs"]["content"]
        if len(content) != len(tokens) or any(c["top_logprobs"][0]["token_id"] != t for c, t in zip(content, tokens)):
            raise RolloutError(f"request {answer.get('request_id')}: log-probs do not follow the sampled tokens")
        lps = torch.tensor([c["top_logprobs"][0]["logprob"] for c in content], dtype=torch.float32)
        cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Sample(list(answer["prompt_token_ids"]), tokens, lps, self.version, int(cached))

    def _recorded(self, jobs: list[tuple[int, int]], samples: list[Sample], where: dict[tuple[int, int], Server],
                  tag: str) -> list[Sample]:
        """`samples` with each server's records of its requests (`RolloutEngine.generate(record=True)`'s fields)."""
        by_server: dict[str, list[str]] = {}
        for i, j in jobs:
            by_server.setdefault(where[(i, j)].url, []).append(f"{RECORD_MARK}{tag}-{i}-{j}")
        found: dict[str, dict] = {}
        for server in list(self.servers):
            if server.url in by_server:
                found.update(server.call("POST", RECORDS_ROUTE, {"request_ids": by_server[server.url]})["records"])
        out = []
        for (i, j), s in zip(jobs, samples):
            got = found.get(f"{RECORD_MARK}{tag}-{i}-{j}", {})
            first, count = len(s.prompt_ids), len(s.completion_ids)
            raw = torch.tensor([math.nan if v is None else v for v in got.get("raw", [])],
                               dtype=torch.float32)[first : first + count]
            if raw.shape[0] != count or bool(raw.isnan().any()):
                raise RolloutError(f"rollout server {where[(i, j)].url} recorded no raw log-prob for some completion "
                                   f"tokens of a request (positions {first}..{first + count - 1})")
            routing = None
            if self.text_cfg.num_moe_layers:
                routing = torch.tensor(got.get("routing", []), dtype=torch.int32)
                if routing.shape[0] != first + count - 1:
                    raise RolloutError(f"rollout server {where[(i, j)].url} recorded routing for {routing.shape[0]} "
                                       f"positions of a request with {first + count - 1} input positions")
            out.append(Sample(s.prompt_ids, s.completion_ids, s.logprobs, s.policy_version, s.cached_tokens, raw,
                              routing))
        return out

    # --- weight sync --------------------------------------------------------------------------------
    def sync(self, bundle: WeightBundle, transport: Transport | None = None) -> SyncResult:
        """Install `bundle` on every server that answers, in two phases (see the module docstring): the live ones and
        any dropped one that is back (restarted: it rejoins at this version). `transport`: None for a
        torch.distributed broadcast (servers anywhere), or a `SharedMemory` (servers on this host) or `Disk` (a
        directory they all read) whose message each server's workers read. A server that dies on the way is dropped
        and the sync goes on with the others; SyncError if a live server refuses, or none is left: every server then
        holds the version it held before."""
        if bundle.kind == "adapter":
            return self._sync_adapter(bundle)
        t0 = time.perf_counter()
        servers = [s for s in [*self.servers, *self.dropped] if self._answers(s)]
        if not servers:
            raise SyncError(NO_SERVER)
        servers = TwoPhaseSync(self, self._drop).run(servers, bundle, transport)
        for s in [s for s in servers if s in self.dropped]:
            self.dropped.remove(s)
            self.log(f"rollout server {s.url} is back, at version {bundle.version}")
        self.servers = servers
        self.version = bundle.version
        return SyncResult(bundle.version, bundle.kind, bundle.nbytes(), time.perf_counter() - t0)

    # --- LoRA -----------------------------------------------------------------------------------------
    def set_policy_adapter(self, name: str, path: str | Path) -> str:
        """Serve the PEFT adapter at `path` as the policy adapter on every live server (`zerokl lora push`: all or
        none), under a name unique to this client; returns the name requests select it by. Later adapter bundles
        (`sync`) must carry the same tensors."""
        from lora.adapter import load_adapter

        adapter = load_adapter(path, self.text_cfg)
        self._policy_spec = adapter.spec
        self._policy_shapes = {n: (tuple(t.shape), torch.float32) for n, t in adapter.tensors().items()}
        self.policy_adapter = f"{name}-{uuid.uuid4().hex[:8]}"
        self._push(Path(path), self.version)
        return self.policy_adapter

    def _sync_adapter(self, bundle: WeightBundle) -> SyncResult:
        """A new version of the policy adapter: verified against its tensors, written as a PEFT directory in the
        servers' adapter directory, pushed to every live server (all or none)."""
        from lora.adapter import Adapter, pair_tensors, save_adapter
        from parity.sync.bundle import verify

        if self.policy_adapter is None:
            raise SyncError("adapter update without a policy adapter: call set_policy_adapter first")
        t0 = time.perf_counter()
        verify(bundle, self._policy_shapes, self.version)
        staged = Path(tempfile.mkdtemp(prefix="zerokl-adapter-")) / "adapter"
        try:
            self._push(save_adapter(Adapter(self._policy_spec, pair_tensors(bundle.tensors, "adapter update")),
                                    staged), bundle.version)
        except ValueError as e:
            raise SyncError(f"adapter update {bundle.version} rejected: {e}") from None
        finally:
            shutil.rmtree(staged.parent, ignore_errors=True)
        self.version = bundle.version
        return SyncResult(bundle.version, bundle.kind, bundle.nbytes(), time.perf_counter() - t0)

    def _push(self, adapter: Path, version: int) -> None:
        """Copy `adapter` into the servers' adapter directory (`zerokl serve --lora-root`, one directory all of them
        read) and push it as `policy_adapter` everywhere; the servers then label their outputs `version`."""
        from lora.push import STATE_ROUTE, PushError, push
        from lora.push import Server as LoraServer

        servers = self.live()
        roots = set()
        for s in servers:
            try:
                roots.add(s.call("GET", STATE_ROUTE)["lora_root"])
            except urllib.error.HTTPError:
                raise SyncError(f"rollout server {s.url} serves no adapters: start it with `zerokl serve "
                                "--lora-root DIR`") from None
        if len(roots) != 1:
            raise SyncError(f"the rollout servers read adapters from different directories {sorted(roots)}; a LoRA "
                            "run needs one directory they all read (--lora-root)")
        target = Path(roots.pop()) / f"{self.policy_adapter}-v{version:08d}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(adapter, target)
        try:
            push([LoraServer(s.url, s.api_key) for s in servers], str(self.policy_adapter), target,
                 log=lambda _: None)
        except (PushError, ValueError) as e:
            shutil.rmtree(target, ignore_errors=True)
            raise SyncError(f"adapter version {version} was not pushed: {e}") from None
        http.each(servers, lambda s: s.call("POST", "/update_weight_version", {"new_version": str(version)}))
        for old in target.parent.glob(f"{self.policy_adapter}-v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def _answers(self, server: Server) -> bool:
        """Whether `server` can take part in a sync (a dropped one is probed: started again, it records anew)."""
        try:
            if server in self.dropped:
                server.workers = int(server.call("GET", "/get_world_size?include_dp=true")["world_size"])
                server.call("POST", RECORDS_START_ROUTE, {})
            server.weights()
            return True
        except (ServerDown, urllib.error.HTTPError) as e:
            if server in self.servers:
                self._drop(server, e)
            return False

    def close(self) -> None:
        """The servers are not this object's: they keep running."""


def _inputs(prompt: Sequence[int] | ImagePrompt) -> dict[str, Any]:
    """The request fields of a prompt: its token ids (placeholders where its images go) and, with images, one PNG
    data URL content part per image."""
    if not isinstance(prompt, ImagePrompt):
        return {"token_ids": list(prompt), "return_token_ids": True}
    parts = []
    for image in prompt.images:
        png = io.BytesIO()
        image.save(png, format="PNG")
        parts.append({"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()})
    return {"token_ids": list(prompt.token_ids), "content_parts": parts, "return_token_ids": True}
