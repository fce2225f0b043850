"""Repository-wide pytest hooks: tests marked ``cuda`` skip, with the reason, where no CUDA GPU is visible
(``pytest -m cuda`` then reports them as skipped; ``benchmarks/gpu/check.sh`` runs them on a GPU)."""

import pytest


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "cuda" in item.keywords]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)
