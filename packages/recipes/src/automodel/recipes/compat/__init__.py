"""NeMo AutoModel's recipe files, read as they are: its keys and ``_target_`` class paths mapped to
this project's (`aliases`, `translate`), its dataset factories (`datasets`), and one start-up line
for each default this project keeps different on purpose (`defaults`)."""

from automodel.recipes.compat.translate import translate

__all__ = ["translate"]
