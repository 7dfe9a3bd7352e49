"""`zerokl serve`: vLLM's OpenAI-compatible server on a K3 checkpoint in parity mode (`serve`), with the middleware of
its weight-sync and versioned-generation routes (`admin`), of its LoRA routes (`lora`) and the worker extension those
routes reach through `collective_rpc` (`worker`).
"""
