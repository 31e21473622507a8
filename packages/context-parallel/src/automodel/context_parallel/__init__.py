"""Context parallelism: CP batch sharding, ring attention on any device, torch SDPA CP and Transformer Engine THD."""
