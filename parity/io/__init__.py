"""Official-format checkpoint I/O: safetensors shards, the tokenizer, vision weight names; shared by every engine."""
