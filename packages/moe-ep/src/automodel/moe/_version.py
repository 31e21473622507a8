"""This package's version, single-sourced from its pyproject.toml; importing it checks the installed
torch / transformers against the declared ranges (the rule lives in `automodel.mesh.versioning`)."""

from automodel.mesh.versioning import Distribution

distribution = Distribution("automodel-moe-ep", __file__)
__version__ = distribution.checked_version()
