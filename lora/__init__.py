"""LoRA adapters for K3 in PEFT format: config and targets, validated loading, random init, merge, trainer state
(see lora/README.md)."""
