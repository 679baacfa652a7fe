"""Seeds derived from names, so random state never depends on the plan.

Every random tensor in hetc (a parameter's initial value, a microbatch's
tokens) gets its own `torch.Generator`, seeded by hashing what identifies it:
the job's seed plus e.g. (layer index, parameter name) or (step, sequence).
Which rank builds it, and what else that rank built first, cannot change it.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["derive_seed", "generator"]


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from `parts`; a stable hash (not Python's salted `hash`)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded by `derive_seed(*parts)`.

    Always on CPU: CUDA generators draw different streams, and values must
    not depend on the device a rank runs on. Callers move the result.
    """
    return torch.Generator(device="cpu").manual_seed(derive_seed(*parts))
