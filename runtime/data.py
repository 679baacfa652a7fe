"""Training data: synthetic tokens or a byte-level text file.

Note [Plan-independent data]
The content of a microbatch depends only on (seed, step, global microbatch
index, micro_batch, seq), never on the plan: microbatch `mb` of step
`step` holds global sequences `step * global_batch + mb * micro_batch + i`,
and sequence `g` is a pure function of (seed, g, seq). Any rank can load any
microbatch without coordination, and every plan sees the same batches.

Each sequence has seq + 1 tokens; the model reads the first seq and
predicts the last seq (tokens[t + 1] is the label of position t).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from hetc.errors import InternalError, SpecError
from hetc.runtime.checks import check_text_vocab
from hetc.runtime.seeding import generator
from hetc.spec import DataKind, ModelSpec, TrainSpec

__all__ = ["DataSource", "SyntheticData", "TextData", "make_data_source"]


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
    """Uniform random tokens in [0, vocab), one generator per sequence."""

    def __init__(self, *, vocab: int, **kw) -> None:
        super().__init__(**kw)
        self.vocab = vocab

    def sequence(self, g: int) -> Tensor:
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=generator(self.seed, "data", g))


class TextData(_Sequences):
    """Byte-level text: each sequence is a window of seq + 1 bytes of the file.

    The file is cut into non-overlapping windows (stride seq); every epoch
    visits all of them once, in an order shuffled by (seed, epoch).
    """

    def __init__(self, *, text: bytes, **kw) -> None:
        super().__init__(**kw)
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        self.num_windows = (len(text) - 1) // self.seq
        if self.num_windows <= 0:
            raise InternalError("make_data_source checks the file's length")
        self._epoch_order: tuple[int, Tensor] | None = None  # the last epoch's window order

    def sequence(self, g: int) -> Tensor:
        epoch, pos = divmod(g, self.num_windows)
        start = int(self._order(epoch)[pos]) * self.seq
        return self.tokens[start:start + self.seq + 1]

    def _order(self, epoch: int) -> Tensor:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            gen = generator(self.seed, "text-epoch", epoch)
            self._epoch_order = (epoch, torch.randperm(self.num_windows, generator=gen))
        return self._epoch_order[1]


def make_data_source(model: ModelSpec, train: TrainSpec, base_dir: Path | str = ".") -> DataSource:
    """The data source of a training job; a relative text path is relative to the spec file that
    declares it (`base_dir` when the spec was built in code).

    A byte-level text needs vocab >= 256 and at least seq + 1 bytes: located
    errors otherwise.
    """
    common = {"seed": train.seed, "seq": model.seq, "micro_batch": train.micro_batch,
              "global_batch": train.global_batch}
    if train.data.kind is DataKind.SYNTHETIC:
        return SyntheticData(vocab=model.vocab, **common)
    if (problem := check_text_vocab(model, train)) is not None:
        raise SpecError.at(model.span_of("vocab"), problem)
    path = train.data.resolve(base_dir)
    try:
        text = path.read_bytes()
    except OSError as err:
        raise SpecError.at(train.data.span_of("path"), f"cannot read the text file '{path}': "
                           f"{err.strerror}") from None
    if len(text) < model.seq + 1:
        raise SpecError.at(train.data.span_of("path"), f"the text file '{path}' has {len(text)} bytes; "
                           f"a sequence of seq = {model.seq} needs {model.seq + 1}")
    return TextData(text=text, **common)
