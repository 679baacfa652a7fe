"""A rank's place inside its lane: its TP shard, its TP/CP collectives, its tokens.

A lane of tp × cp ranks serves one microbatch together (hetc/pipeline.py);
`LanePlace` is what one of them needs to run its ministages: which slice of
the weights it holds (`TPShard`), the groups its compute talks over, and the
tokens it holds at the borders (hetc/layout.py). `place_ministage` wires a
built ministage for it: the TP comm (runtime/tensor_parallel.py), the
attention core (Ulysses or ring attention for cp > 1) and the token layout
(positions for RoPE and learned embeddings, the loss's share of the mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hetc.layout import SeqLayout, attention_ranges, boundary_ranges, positions
from hetc.runtime.attention import Attention
from hetc.runtime.model import Ministage, TokenLayout
from hetc.runtime.ring_attention import RingAttention
from hetc.runtime.tensor_parallel import GroupTP
from hetc.runtime.tp import NO_SHARD, TPShard, set_tp_comm
from hetc.runtime.ulysses import UlyssesAttention
from hetc.spec import CPKind

__all__ = ["LanePlace", "place_ministage", "take_tokens"]


@dataclass(frozen=True)
class LanePlace:
    """Lane position `pos` (cp_rank · tp + tp_rank) of a lane with `layout`, for sequences of `seq`.

    tp_group / cp_group are process groups (None when that size is 1);
    cp_ranks the global ranks of the cp group in cp order (ring neighbours).
    """

    layout: SeqLayout
    pos: int
    seq: int
    tp_group: object | None = None
    cp_group: object | None = None
    cp_ranks: tuple[int, ...] = ()

    @property
    def tp_rank(self) -> int:
        return self.pos % self.layout.tp

    @property
    def cp_rank(self) -> int:
        return self.pos // self.layout.tp

    @property
    def shard(self) -> TPShard:
        return TPShard(self.tp_rank, self.layout.tp) if self.layout.tp > 1 else NO_SHARD

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return boundary_ranges(self.layout, self.pos, self.seq)

    @property
    def splits_sequence(self) -> bool:
        return self.ranges != ((0, self.seq),)

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss is its own share (not a tp replica of another rank's)."""
        return self.tp_rank == 0 or self.layout.sequence_parallel


def place_ministage(module: Ministage, place: LanePlace, device: torch.device | str = "cpu") -> None:
    """Wire `module` (built with `place.shard`) for its lane: collectives, attention core, tokens."""
    layout = place.layout
    if layout.tp > 1:
        set_tp_comm(module, GroupTP(place.tp_group, layout.sequence_parallel))
    if layout.cp > 1:
        core = UlyssesAttention(place.cp_group) if layout.cp_kind is CPKind.ULYSSES else \
            RingAttention(place.cp_group, place.cp_ranks, place.cp_rank)
        for sub in module.modules():
            if isinstance(sub, Attention):
                sub.core = core
    if place.splits_sequence:
        def tensor(ranges) -> Tensor:
            return torch.tensor(positions(ranges), dtype=torch.long, device=device)
        module.token_layout = TokenLayout(tensor(place.ranges),
                                          tensor(attention_ranges(layout, place.pos, place.seq)), place.seq)


def take_tokens(x: Tensor, place: LanePlace) -> Tensor:
    """This rank's tokens (dim 1) of a whole-sequence tensor such as a microbatch's token ids or labels."""
    if not place.splits_sequence:
        return x
    return torch.cat([x[:, a:b] for a, b in place.ranges], dim=1)
