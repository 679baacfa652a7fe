"""Training and evaluation data: synthetic tokens, a byte-level text file, a token file.

Note [Plan-independent data]
The content of a microbatch depends only on (seed, step, global microbatch
index, micro_batch, seq), never on the plan: microbatch `mb` of step
`step` holds global sequences `step * global_batch + mb * micro_batch + i`,
and sequence `g` is a pure function of (seed, g, seq). Any rank can load any
microbatch without coordination, and every plan sees the same batches.
Evaluation batch k is read the same way from the evaluation source, with k
in place of the step.

Each sequence has seq + 1 tokens; the model reads the first seq and
predicts the last seq (tokens[t + 1] is the label of position t).

Note [Windows]
A text file (one token per byte) and a token file (hetc/ir/tokenfile.py) are
both a stream of N ids, read a window at a time (Note [reading a file that
may shrink] in hetc/ir/tokenstream.py), cut into W = (N - 1) // seq windows
of seq + 1 ids with stride seq (neighbours share one id: the last label of
one is the first input of the next). With `shuffle = false` global
sequence g is window g mod W: ids [g·seq, (g+1)·seq] in the first epoch,
so any other tool can reproduce a run's batches. With `shuffle = true`
epoch e = g div W visits every window once, in an order drawn from
(seed, e) (a permutation of W indices, 8 bytes per window, made once per
epoch). `eval_share` keeps the last ceil(W · share) windows for validation,
read in order; training windows are the ones before them.

Note [Blends]
`data blend` mixes text and token files by weight, as Megatron-LM's
`--data-path W1 P1 W2 P2` does, and by its rule: global sequence g goes to
the source whose count of sequences so far falls furthest below its share
of g + 1 (the first on a tie), and is that source's next sequence, read as
the source alone would read it (its windows, its own shuffled epochs). The
shares are the weights normalised, as whole slots of a period P (the
smallest P <= 65,536 that makes every share whole: 10 for 0.7 and 0.3,
else 65,536 with the largest remainders), so the assignment repeats every
P sequences and sequence g is found in O(1): period q = g div P, slot
r = g mod P, index q · (the source's slots) + (its slots before r). On
exact shares it is Megatron-LM's blending index, sequence for sequence.
`eval_share` holds out the end of every source (Note [Windows]), and the
validation data is their held-out windows blended by the same weights, as
Megatron-LM's --split divides each dataset of a blend.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from hetc.ir.errors import InternalError, Span, SpecError
from hetc.passes.validate_runtime import check_text_vocab
from hetc.runtime.nn.seeding import generator
from hetc.ir.spec import DataFileSpec, DataKind, DataSpec, ModelSpec, TrainSpec
from hetc.ir.tokenfile import TokenFileError, check_vocab, inspect_tokens, open_tokens
from hetc.ir.tokenstream import TokenStream, TruncatedError

__all__ = [
    "BlendedData",
    "DataError",
    "DataSource",
    "SyntheticData",
    "TextData",
    "Windows",
    "blend_period",
    "make_data_source",
    "make_eval_source",
    "split_held_out",
]


# A stream of ids: an array in memory, or a file's read as windows are (hetc/ir/tokenstream.py).
Ids = np.ndarray | TokenStream


class DataError(ValueError):
    """The data breaks a rule that only reading it shows (an id beyond the vocabulary): a user error."""


class DataSource(Protocol):
    def get_microbatch(self, step: int, mb: int) -> tuple[Tensor, Tensor]:
        """(tokens [b, S] int64, labels [b, S] int64) of global microbatch `mb` of 0-based `step`."""
        ...


class _Sequences(ABC):
    """Shared microbatch assembly: subclasses define `sequence(g) -> [seq + 1] int64`."""

    def __init__(self, *, seed: int, seq: int, micro_batch: int, global_batch: int) -> None:
        if global_batch % micro_batch:
            raise InternalError("the validator checks global_batch % micro_batch")
        self.seed, self.seq = seed, seq
        self.micro_batch, self.global_batch = micro_batch, global_batch

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    @abstractmethod
    def sequence(self, g: int) -> Tensor:
        """Global sequence `g`: seq + 1 int64 tokens."""

    def get_microbatch(self, step: int, mb: int) -> tuple[Tensor, Tensor]:
        if not 0 <= mb < self.num_microbatches:
            raise InternalError(f"microbatch {mb} of {self.num_microbatches}")
        first = step * self.global_batch + mb * self.micro_batch
        rows = torch.stack([self.sequence(first + i) for i in range(self.micro_batch)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class SyntheticData(_Sequences):
    """Uniform random tokens in [0, vocab), one generator per sequence (of the named stream)."""

    def __init__(self, *, vocab: int, stream: str = "data", **kw) -> None:
        super().__init__(**kw)
        self.vocab, self.stream = vocab, stream

    def sequence(self, g: int) -> Tensor:
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=generator(self.seed, self.stream, g))


class Windows(_Sequences):
    """Windows of seq + 1 ids cut from a stream of ids (Note [Windows])."""

    def __init__(self, *, tokens: Ids, shuffle: bool = True, vocab: int | None = None,
                 where: str = "the data", epochs: tuple[str | int, ...] = (), **kw) -> None:
        super().__init__(**kw)
        self.tokens, self.shuffle, self.vocab, self.where = tokens, shuffle, vocab, where
        self.epochs = epochs    # what names its epochs' shuffles besides the seed: a blend's source index
        self.num_windows = (len(tokens) - 1) // self.seq
        if self.num_windows <= 0:
            raise InternalError("make_data_source checks the stream's length")
        self._epoch_order: tuple[int, Tensor] | None = None  # the last epoch's window order

    def window_start(self, g: int) -> int:
        """The offset of global sequence g's first id in the stream."""
        epoch, pos = divmod(g, self.num_windows)
        return (int(self._order(epoch)[pos]) if self.shuffle else pos) * self.seq

    def sequence(self, g: int) -> Tensor:
        start = self.window_start(g)
        try:
            ids = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq + 1]).astype(np.int64))
        except TruncatedError as err:
            raise DataError(str(err)) from None
        if self.vocab is not None and int(ids.max()) >= self.vocab:
            at = start + int((ids >= self.vocab).nonzero()[0])
            raise DataError(f"{self.where} holds the id {int(ids[at - start])} at token {at}, outside the "
                             f"model's vocab = {self.vocab}")
        return ids

    def _order(self, epoch: int) -> Tensor:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            gen = generator(self.seed, "text-epoch", *self.epochs, epoch)
            self._epoch_order = (epoch, torch.randperm(self.num_windows, generator=gen))
        return self._epoch_order[1]


class TextData(Windows):
    """Byte-level text: one token per byte, windows shuffled per epoch."""

    def __init__(self, *, text: bytes | Ids, **kw) -> None:
        tokens = np.frombuffer(text, dtype=np.uint8) if isinstance(text, bytes) else text
        super().__init__(tokens=tokens, **kw)


class BlendedData(_Sequences):
    """Sequences of several sources, mixed by weight (Note [Blends])."""

    def __init__(self, *, sources: Sequence[_Sequences], weights: list[float], **kw) -> None:
        super().__init__(**kw)
        self.sources = sources
        self.slot_source, self.slot_index, self.per_period = blend_period(weights)

    def sequence(self, g: int) -> Tensor:
        period, slot = divmod(g, len(self.slot_source))
        source = int(self.slot_source[slot])
        return self.sources[source].sequence(period * self.per_period[source] + int(self.slot_index[slot]))


MAX_PERIOD = 65_536


def blend_period(weights: list[float]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(each slot's source, its index among that source's slots, each source's slots) of the period that
    mixes `weights` by Megatron-LM's rule (Note [Blends])."""
    shares = [w / sum(weights) for w in weights]
    period = next((p for p in range(1, MAX_PERIOD) if all(abs(s * p - round(s * p)) < 1e-9 for s in shares)),
                  MAX_PERIOD)
    slots = [math.floor(s * period) for s in shares]      # the largest remainders take the slots left
    for d in sorted(range(len(shares)), key=lambda d: slots[d] - shares[d] * period)[:period - sum(slots)]:
        slots[d] += 1
    source, index, taken = np.empty(period, np.int64), np.empty(period, np.int64), [0] * len(slots)
    for g in range(period):     # integers: slots[d] (g + 1) / period - taken[d], times period
        d = max(range(len(slots)), key=lambda d: (slots[d] * (g + 1) - taken[d] * period, -d))
        source[g], index[g] = d, taken[d]
        taken[d] += 1
    return source, index, slots


def split_held_out(tokens: Ids, seq: int, share: float) -> tuple[Ids, Ids]:
    """(training ids, held-out ids): the last ceil(W · share) windows are held out (Note [Windows])."""
    windows = (len(tokens) - 1) // seq
    held = max(1, math.ceil(windows * share))
    if windows - held < 1:
        raise ValueError(f"{len(tokens)} tokens make {windows} windows of seq = {seq}; holding out {held} "
                         "leaves none to train on")
    cut = (windows - held) * seq
    return tokens[:cut + 1], tokens[cut:]


def make_data_source(model: ModelSpec, train: TrainSpec, base_dir: Path | str = ".") -> DataSource:
    """The training data of a job; a relative path is relative to the spec file that declares it
    (`base_dir` when the spec was built in code). With `eval_share`, the held-out windows are left out.

    A byte-level text needs vocab >= 256, a stream at least seq + 1 ids: located errors otherwise.
    """
    return _source(model, train, train.data, base_dir, held_out=False)


def make_eval_source(model: ModelSpec, train: TrainSpec, base_dir: Path | str = ".") -> DataSource | None:
    """The validation data: the eval block's, or the training data's held-out share (None: no evaluation)."""
    if train.eval_every == 0:
        return None
    if train.eval is not None:
        return _source(model, train, train.eval, base_dir, held_out=False, stream="eval")
    return _source(model, train, train.data, base_dir, held_out=True)


def _source(model: ModelSpec, train: TrainSpec, data: DataSpec, base_dir: Path | str, *, held_out: bool,
            stream: str = "data") -> _Sequences:
    common = {"seed": train.seed, "seq": model.seq, "micro_batch": train.micro_batch,
              "global_batch": train.global_batch}
    if data.kind is DataKind.SYNTHETIC:
        return SyntheticData(vocab=model.vocab, stream=stream, **common)
    if (problem := check_text_vocab(model, train)) is not None:
        raise SpecError.at(model.span_of("vocab"), problem)
    split = train.eval_share > 0 and data is train.data     # eval_share: each file's end is held out
    if data.kind is DataKind.BLEND:     # Note [Blends]
        sources = [_file_source(model, train, s, base_dir, common, split=split, held_out=held_out, epochs=(i,))
                   for i, s in enumerate(data.sources)]
        return BlendedData(sources=sources, weights=[s.weight for s in data.sources], **common)
    return _file_source(model, train, data, base_dir, common, split=split, held_out=held_out)


def _file_source(model: ModelSpec, train: TrainSpec, data: DataFileSpec, base_dir: Path | str, common: dict[str, int],
                 *, split: bool, held_out: bool, epochs: tuple[str | int, ...] = ()) -> Windows:
    """A file's windows: with `split`, those before its held-out share, or (`held_out`) that share."""
    path = data.resolve(base_dir)
    tokens: Ids = _stream(data, path, model.vocab)
    where = data.span_of("path")
    if split:
        try:
            kept, held = split_held_out(tokens, model.seq, train.eval_share)
        except ValueError as err:
            raise SpecError.at(train.span_of("eval_share"), f"'{path}': {err}") from None
        tokens = held if held_out else kept
    _check_length(tokens, model.seq, path, where)
    shuffle = data.shuffle and not held_out
    if data.kind is DataKind.TEXT:   # a byte is always below vocab >= 256
        return TextData(text=tokens, shuffle=shuffle, where=f"'{path}'", epochs=epochs, **common)
    return Windows(tokens=tokens, shuffle=shuffle, vocab=model.vocab, where=f"'{path}'", epochs=epochs, **common)


def _stream(data: DataFileSpec, path: Path, vocab: int) -> TokenStream:
    """The file's ids, checked as `hetc check` checks them (passes/data_check.py), read as windows are."""
    try:
        if data.kind is DataKind.TEXT:
            return TokenStream.of_file(path, "uint8", 0, path.stat().st_size)
        tf = inspect_tokens(path, data.dtype)
        check_vocab(tf, vocab)
        return open_tokens(tf)
    except TokenFileError as err:
        raise SpecError.at(data.span_of(err.field), str(err)) from None
    except (OSError, ValueError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise SpecError.at(data.span_of("path"), f"cannot read the {data.kind.value} file '{path}': {why}") from None


def _check_length(tokens: Ids, seq: int, path: Path, where: Span) -> None:
    if len(tokens) < seq + 1:
        unit = "bytes" if tokens.dtype == np.uint8 else "tokens"
        raise SpecError.at(where, f"the file '{path}' has {len(tokens)} {unit}; a sequence of seq = {seq} "
                           f"needs {seq + 1}")
