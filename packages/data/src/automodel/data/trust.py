"""What loading runs: the one place that says so when a YAML lets a model directory run its code.

Model directories, tokenizers and checkpoints are data, not code: ``trust_remote_code`` is off
unless the YAML sets ``model.trust_remote_code`` / ``tokenizer.trust_remote_code`` to true, and
then rank 0 prints one line naming the directory whose Python files will be imported.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def announce_remote_code(*, key: str, path: str) -> None:
    """Print on rank 0 (stderr) that `key` is true and code from `path` may run."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(
        f"{key}: true -- Python code shipped in {path} (config.json / tokenizer_config.json auto_map) "
        "will be imported and run; set it only for directories you trust",
        file=sys.stderr,
        flush=True,
    )
