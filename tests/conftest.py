"""Test-suite hooks: tests marked ``gpu`` are skipped on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu`` test when CUDA is absent; they stay collected, so ``-m gpu`` lists them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
