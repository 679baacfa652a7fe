"""A rank's place inside its lane: its TP shard, its TP/CP/EP collectives, its tokens.

A lane of tp × cp ranks serves one microbatch together (hetc/ir/pipeline.py);
`LanePlace` is what one of them needs to run its ministages: which slice of
the weights it holds (`TPShard`), the groups its compute talks over, and the
tokens it holds at the borders (hetc/ir/layout.py). `place_ministage` wires a
built ministage for it: the TP comm (runtime/nn/tensor_parallel.py), the
attention core (Ulysses or ring attention for cp > 1), the token layout
(positions for RoPE and learned embeddings, the loss's share of the mean)
and the MoE blocks' expert exchange and routing (runtime/nn/moe.py).
`Arrivals` assembles the boundary tensors that arrive in pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hetc.ir.layout import (SeqLayout, arrival_ranges, attention_ranges, boundary_ranges, held_length, local_slice,
                            positions)
from hetc.runtime.nn.attention import Attention
from hetc.runtime.nn.layers import Block, Embedding
from hetc.runtime.nn.model import Ministage, TokenLayout
from hetc.runtime.nn.moe import ALL_EXPERTS, ExpertExchange, ExpertShard, MoE, SequenceRouting
from hetc.runtime.nn.ring_attention import RingAttention
from hetc.runtime.nn.tensor_parallel import GroupTP, gather_parts
from hetc.runtime.nn.tensor_parallel import NO_SHARD, TPShard, set_tp_comm
from hetc.runtime.nn.ulysses import UlyssesAttention
from hetc.ir.spec import CPKind

__all__ = ["Arrivals", "LanePlace", "place_ministage", "take_tokens"]


@dataclass(frozen=True)
class LanePlace:
    """Lane position `pos` (cp_rank · tp + tp_rank) of a lane with `layout`, for sequences of `seq`.

    tp_group / cp_group / ep_group are process groups (None when that size
    is 1); cp_ranks the global ranks of the cp group in cp order (ring
    neighbours); experts the experts of MoE blocks this rank holds.
    """

    layout: SeqLayout
    pos: int
    seq: int
    tp_group: object | None = None
    cp_group: object | None = None
    cp_ranks: tuple[int, ...] = ()
    ep_group: object | None = None
    experts: ExpertShard = ALL_EXPERTS

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
    def arrives(self) -> tuple[tuple[int, int], ...]:
        """The tokens this rank receives of a boundary tensor (Note [scatter-gather borders])."""
        return arrival_ranges(self.layout, self.pos, self.seq)

    def arrivals(self) -> Arrivals:
        """An empty `Arrivals` for this rank: its parts gathered over its tp group where they are parts."""
        held, arrives = self.ranges, self.arrives
        return Arrivals(held, arrives, self.tp_group if arrives != held else None)

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
    if layout.tp > 1 and layout.sequence_parallel:
        for sub in module.modules():     # each tp rank holds a part of the hidden state (Note [dropout streams])
            if isinstance(sub, (Block, Embedding)):
                sub.dropout_part = place.tp_rank
    if layout.cp > 1:
        # Ulysses runs the model's own core (flash or unfused) on its heads; ring attention is blockwise flash
        # (validation refuses it beside attention = unfused)
        ring = RingAttention(place.cp_group, place.cp_ranks, place.cp_rank) if layout.cp_kind is CPKind.RING \
            else None
        for sub in module.modules():
            if isinstance(sub, Attention):
                sub.core = ring if ring is not None else UlyssesAttention(place.cp_group, sub.core)
    if place.splits_sequence:
        def tensor(ranges) -> Tensor:
            return torch.tensor(positions(ranges), dtype=torch.long, device=device)
        module.token_layout = TokenLayout(tensor(place.ranges),
                                          tensor(attention_ranges(layout, place.pos, place.seq)), place.seq)
    _place_experts(module, place, device)


def _place_experts(module: Ministage, place: LanePlace, device: torch.device | str) -> None:
    """MoE blocks: the EP group's dispatch and combine, and the cp group that shares a microbatch's routing."""
    routing = None
    if place.layout.cp > 1:
        mine = torch.tensor(positions(place.ranges), dtype=torch.long, device=device)
        routing = SequenceRouting(place.cp_group, mine, place.seq)
    for sub in module.modules():
        if isinstance(sub, MoE):
            sub.exchange = ExpertExchange(place.ep_group, place.experts.size)
            sub.routing = routing


def take_tokens(x: Tensor, place: LanePlace) -> Tensor:
    """This rank's tokens (dim 1) of a whole-sequence tensor such as a microbatch's token ids or labels."""
    if not place.splits_sequence:
        return x
    return torch.cat([x[:, a:b] for a, b in place.ranges], dim=1)


class Arrivals:
    """Boundary tensors received from other ranks, whole or in pieces of the sequence.

    A piece (`recv ... seq=a:b`, Note [border pieces] in passes/lower/p2p.py)
    is copied into place in a tensor holding the tokens this rank receives
    (`arrives`); the tensor can be taken once every token has arrived (the
    verifier proved that the pieces tile them, `hetc.ir.layout.tiling_problem`;
    here they are counted). With a `gather` group those are the rank's tp part
    of the tokens it holds (`held`), all-gathered over the group when taken
    (Note [scatter-gather borders] in hetc/ir/layout.py).
    """

    def __init__(self, held: tuple[tuple[int, int], ...], arrives: tuple[tuple[int, int], ...],
                 gather: object | None) -> None:
        self.held, self.arrives, self.gather = held, arrives, gather
        self.tokens = held_length(self.arrives)
        self.ready: dict[tuple, Tensor] = {}
        self.partial: dict[tuple, tuple[Tensor, int]] = {}     # key -> (tensor being filled, tokens so far)

    def __contains__(self, key: tuple) -> bool:
        return key in self.ready or key in self.partial

    def put(self, key: tuple, tensor: Tensor, seq: tuple[int, int] | None) -> None:
        if seq is None:
            if key in self:
                raise RuntimeError(f"{key} is received twice")
            self.ready[key] = tensor
            return
        target, filled = self.partial.pop(key, (None, 0))
        if target is None:
            if key in self.ready:
                raise RuntimeError(f"a piece of {key} arrives after the whole tensor")
            target = tensor.new_empty((tensor.shape[0], self.tokens, *tensor.shape[2:]))
        target[:, local_slice(self.arrives, seq)] = tensor
        filled += seq[1] - seq[0]
        if filled == self.tokens:
            self.ready[key] = target
        else:
            self.partial[key] = (target, filled)

    def take(self, key: tuple) -> Tensor | None:
        """The complete tensor (removed), None if nothing of it arrived; an error if only some pieces did."""
        if key in self.partial:
            raise RuntimeError(f"only {self.partial[key][1]} of the {self.tokens} tokens of {key} have arrived")
        got = self.ready.pop(key, None)
        if got is None or self.gather is None:
            return got
        return gather_parts(got, self.gather)

    def local(self, tensor: Tensor, seq: tuple[int, int] | None) -> Tensor:
        """What to send of this rank's boundary tensor: all of it, or the tokens of `seq`."""
        return tensor if seq is None else tensor[:, local_slice(self.held, seq)]
