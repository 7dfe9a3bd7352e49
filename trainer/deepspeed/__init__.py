"""The DeepSpeed ZeRO trainer (trainer/deepspeed/README.md): module, engine, I/O, LoRA, `DeepSpeedBackend`."""
