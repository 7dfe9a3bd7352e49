"""The rollout side: vLLM generates, zerokl's model computes.

Rooms, each a package with one job (imports point down the list, and every room may use `parity` and `lora`):
- `rollout.engine`, `rollout.sampling`, `rollout.speculative`, `rollout.worker_processes`: what a caller uses in its
  own process (the offline `RolloutEngine` over `vllm.LLM`, the `Sample` record and per-sample seeds, the checks on
  speculative settings, vLLM's CPU workers forked from a preloaded server);
- `rollout.client`: rollouts and weight sync over HTTP from running `zerokl serve` servers, and servers started for one
  run on this machine;
- `rollout.server`: `zerokl serve` (vLLM's OpenAI server) and what it adds to vLLM's API process and workers;
- `rollout.vllm`: everything vLLM loads in its own processes (the plugin entry point, the model classes, caches and
  attention backends, draft models, the weight-transfer backend, the recorders, the compat patches);
- `rollout.generate`: a generator on the rollout model code without vLLM (a paged latent pool, a CUDA-graphed decode
  step), which the GPU benchmarks use.
"""
