"""Generation on the rollout model code without vLLM: a paged MLA latent pool laid out as vLLM's (`paged_pool`) and a
batched decode step captured in a CUDA graph (`decode_graph`). The GPU benchmarks use it where vLLM does not run.
"""
