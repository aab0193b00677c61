"""Bundled demo models for specfleet: corpora, tokenizer, target and domain drafters.

Entry points: :func:`build_main` (``specfleet models build``) and :func:`matrix_main`
(``specfleet models matrix``).
"""

from .acceptance import matrix_main
from .build import build_main

__all__ = ["build_main", "matrix_main"]
