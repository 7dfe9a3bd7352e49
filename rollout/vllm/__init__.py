"""What vLLM loads in its own processes (main, engine core, workers) to run zerokl's K3: the `vllm.general_plugins`
entry point (`plugin`), the model classes (`model`, `vision`, the MTP and DSpark drafts `mtp`, `dspark`), K3's caches
and attention backends in vLLM's cache memory (`caches`, `backends`), LoRA slots (`lora_table`), what the worker
records beside vLLM's outputs (`records`), the `zerokl` weight-transfer backend (`weight_transfer`) and the patches of
vLLM's internals (`compat`). Nothing here is imported until vLLM asks for it (the plugin registers by module path).
"""
