"""Optional speed-ups of the same model: Liger's kernels (``kernels:``, extra
``automodel-recipes[kernels]``) and torchao float8 training (``fp8:``, extra
``automodel-recipes[fp8]``). Both packages are imported only when a section asks for them."""

from automodel.recipes.config.kernels import FP8Section, KernelsSection, parse_kernels_sections

__all__ = ["FP8Section", "KernelsSection", "parse_kernels_sections"]
