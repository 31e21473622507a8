"""YAML -> composed model -> training loop, checkpoints, and the `recipes` CLI."""
