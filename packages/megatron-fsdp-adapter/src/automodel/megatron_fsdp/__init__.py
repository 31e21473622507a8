"""strategy: megatron_fsdp through the megatron-fsdp package."""
