"""Which torch device a process computes on."""

from __future__ import annotations

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; any explicit torch device string is honoured."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)
