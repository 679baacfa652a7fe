"""Dropout that the ranks of a lane draw consistently (Note [dropout streams]).

Note [dropout streams]
~~~~~~~~~~~~~~~~~~~~~~
A lane's tp ranks hold some tensors whole (the hidden state without sequence
parallelism) and others in parts (a rank's attention heads; the hidden state
under sequence parallelism). A dropout over a whole tensor must draw one
mask on every rank that holds it, or the replicas part and their gradients
no longer belong to one model; a dropout over parts must draw a different
mask for each part, or every tp rank's heads drop the same positions.
Megatron-LM keeps two generator states for this (its RNG tracker); hetc:

- each step, every rank seeds torch's default generators from (job seed,
  step, its tp group's first global rank) (`seed_step`): the tp ranks of a
  lane position share the stream, and every lane, cp position and stage
  draws its own. The runtime takes nothing else from those generators
  (every other random tensor has its own, runtime/nn/seeding.py), and the
  ranks sharing a stream run the same ops in the same order, so a whole
  tensor's mask is the same on each;
- a dropout over a part (`dropout(..., part=i)`, `part_stream`) takes a seed from the
  shared stream, which leaves it in step on every rank, and draws the mask
  under `torch.random.fork_rng` from that seed plus the part's index.

Activation recomputation replays the masks: torch.utils.checkpoint restores
the generators' state before it runs a forward again (preserve_rng_state), so
the shared draws and the seeds the forks take repeat; activation offload's
recomputation, which runs outside it, restores them itself (`replaying`). On
a GPU this relies on CUDA's default generator being counter-based (Philox: a
seed and an offset, which is all its state): F.dropout and SDPA's in-kernel
dropout draw from it, and setting that state back makes every kernel draw
the same numbers again, whatever ran in between. A step's masks depend
on the step, not on what ran before, so a resumed run draws what the
uninterrupted one did; they do depend on the plan (a 1-rank run and a tp-2
run of one spec drop different elements, as in Megatron-LM): plan invariance
holds at dropout 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from hetc.runtime.nn.seeding import derive_seed

__all__ = ["RngState", "dropout", "part_stream", "replaying", "rng_state", "seed_step"]

# the default generators' state: the host's, and the device's on a GPU
RngState = tuple[Tensor, Tensor | None]


def seed_step(seed: int, step: int, stream: int) -> None:
    """Seed torch's default generators (host and devices) for `step` of the ranks sharing `stream`."""
    torch.manual_seed(derive_seed(seed, "dropout", step, stream))


@contextlib.contextmanager
def part_stream(part: int | None, device: torch.device) -> Iterator[None]:
    """Draw on the stream of part `part` of a tensor held in parts (None: on the shared stream, for a tensor
    every rank sharing it holds whole): a seed from the shared stream, the same on each of them, plus the
    part's index, under a fork that leaves the shared stream where the seed's draw put it."""
    if part is None:
        yield
        return
    seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64)) + part
    with _forked(device):
        torch.manual_seed(seed)
        yield


def _forked(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Generators drawn from inside are set back on leaving: the host's, and `device`'s on a GPU."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])


def rng_state(device: torch.device) -> RngState:
    """Where the default generators stand, to draw the same masks again (`replaying`)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replaying(state: RngState, device: torch.device) -> Iterator[None]:
    """Run a forward again from `state` (a recomputation outside torch.utils.checkpoint: activation
    offload's), leaving the generators where they were."""
    with _forked(device):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def dropout(x: Tensor, p: float, training: bool, part: int | None = None) -> Tensor:
    """`F.dropout` while training, on the stream of `part` (`part_stream`); the identity otherwise."""
    if p == 0 or not training:
        return x
    with part_stream(part, x.device):
        return F.dropout(x, p, training=True)
