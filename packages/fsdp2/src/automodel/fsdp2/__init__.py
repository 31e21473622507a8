"""FSDP2/HSDP, tensor and sequence parallel, activation checkpointing and DDP for Hugging Face models."""
