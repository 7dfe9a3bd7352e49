"""The K3 trainer on megatron-core: Megatron modules own parameters, sharding and communication; the numerics are
the shared forward in `parity.model` (see trainer/megatron/README.md)."""
