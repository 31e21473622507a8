"""YAML -> composed model -> training loop, checkpoints, and the `recipes` CLI."""

from automodel.recipes._version import __version__ as __version__
