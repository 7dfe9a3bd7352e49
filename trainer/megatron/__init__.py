"""The Megatron-core trainer (trainer/megatron/README.md): modules, sharding, checkpoint I/O, the train step, `MegatronBackend`."""
