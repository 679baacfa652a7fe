"""Token files: the layouts `data tokens` reads and `hetc data prepare` writes (torch-free).

Note [Token file layouts]
Every layout is, to hetc, one stream of token ids read through a numpy
memmap (never whole in memory); sequence windows are cut from the stream
(runtime/data.py).

- raw (nanoGPT): the file is nothing but the ids, little-endian uint16 or
  uint32; `dtype` in the spec says which.
- hetc (`hetc data prepare`): the raw ids after a header. The file starts
  with the magic b"HETCTOK\\x00", a little-endian uint32 giving the byte
  offset of the first id (4096 as written), then a UTF-8 JSON object padded
  with spaces up to that offset: format, version, dtype, vocab (the
  tokenizer's size, added tokens included), tokenizer (its directory's name),
  tokenizer_sha256 (of tokenizer.json), eos, documents, tokens. Any tool can
  read the ids with `numpy.memmap(path, dtype, offset=offset)`.
- megatron: Megatron-LM's indexed dataset, PREFIX.bin holding the ids of
  every sequence back to back and PREFIX.idx describing them: the magic
  b"MMIDIDX\\x00\\x00", version (<Q, 1), the dtype code (<B: 1 uint8, 2 int8,
  3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence
  count (<Q), the document count (<Q, which is documents + 1), then the
  sequence lengths (int32 × sequences), the sequence byte offsets into .bin
  (int64 × sequences) and the document indices (int64 × document count: the
  first sequence of each document, ending with the sequence count). hetc
  reads codes 8 and 4 (Megatron writes int32 once the vocabulary passes
  65500; it is `dtype = uint32` here) and concatenates the sequences in file
  order, so the stream is the .bin itself; sequences that do not lie back to
  back are an error.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hetc.jsontypes import JsonObject
from hetc.spec import TokenDType

__all__ = [
    "HETC_MAGIC",
    "HETC_OFFSET",
    "MEGATRON_MAGIC",
    "Layout",
    "TokenFile",
    "TokenFileError",
    "dtype_for_vocab",
    "fits",
    "inspect_tokens",
    "looks_binary",
    "open_tokens",
    "tokenizer_digest",
    "write_hetc_header",
    "write_megatron_index",
]

HETC_MAGIC = b"HETCTOK\x00"
HETC_OFFSET = 4096            # where `prepare` puts the first id: a page, room for the JSON
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_CODES = {8: "uint16", 4: "int32"}
_CODE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
               8: "uint16"}
_WIDTH = {TokenDType.UINT16: "uint16", TokenDType.UINT32: "uint32"}


class TokenFileError(ValueError):
    """A token file hetc cannot read as its spec says; the message is for the user."""


class Layout(StrEnum):
    RAW = "raw"
    HETC = "hetc"
    MEGATRON = "megatron"


@dataclass(frozen=True)
class TokenFile:
    """Where the ids of a token file are and what its header (if any) says about them."""

    layout: Layout
    data: Path                   # the file holding the ids (PREFIX.bin for Megatron)
    offset: int                  # byte offset of the first id
    dtype: str                   # numpy dtype name: uint16, uint32 or int32
    num_tokens: int
    vocab: int | None = None     # the tokenizer's vocabulary (hetc header only)
    tokenizer: str | None = None
    index: Path | None = None    # PREFIX.idx
    tokenizer_sha256: str | None = None

    @property
    def max_id(self) -> int:
        """The largest id the dtype holds."""
        return int(np.iinfo(self.dtype).max)


def fits(dtype: TokenDType, vocab: int) -> bool:
    """Whether ids 0..vocab-1 fit in `dtype`."""
    return vocab - 1 <= int(np.iinfo(_WIDTH[dtype]).max)


def dtype_for_vocab(vocab: int) -> TokenDType:
    return TokenDType.UINT16 if fits(TokenDType.UINT16, vocab) else TokenDType.UINT32


def tokenizer_digest(directory: Path) -> str:
    """What a token file's header records of the tokenizer that wrote it: sha256 of its tokenizer.json."""
    return hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()


def looks_binary(path: Path, probe: int = 1 << 16) -> str | None:
    """Why the file at `path` is not text (None: it may be): a token file, or NUL bytes near its start."""
    with open(path, "rb") as f:
        head = f.read(probe)
    if head.startswith(HETC_MAGIC):
        return "it is a token file written by `hetc data prepare`"
    if head.startswith(MEGATRON_MAGIC):
        return "it is a Megatron index (.idx)"
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"it holds NUL bytes (the first at byte {nul}), so it looks like binary token ids"
    return None


def inspect_tokens(path: Path, dtype: TokenDType | None) -> TokenFile:
    """Read the headers only (cheap enough for `hetc check`); TokenFileError when they do not fit."""
    prefix = _megatron_prefix(path)
    if prefix is not None:
        return _inspect_megatron(prefix, dtype)
    if not path.is_file():
        raise TokenFileError(f"cannot find the token file '{path}'")
    with open(path, "rb") as f:
        head = f.read(len(HETC_MAGIC))
    if head == HETC_MAGIC:
        return _inspect_hetc(path, dtype)
    if dtype is None:
        raise TokenFileError(f"'{path}' has no header, so it is read as raw ids (nanoGPT's layout): "
                             "say how wide they are with dtype = uint16 or uint32")
    width = np.dtype(_WIDTH[dtype]).itemsize
    size = path.stat().st_size
    if size % width:
        raise TokenFileError(f"'{path}' has {size} bytes, not a whole number of {dtype.value} ids")
    return TokenFile(Layout.RAW, path, 0, _WIDTH[dtype], size // width)


def open_tokens(tf: TokenFile) -> np.ndarray:
    """The file's ids as a read-only memmap (the OS pages them in as windows are read)."""
    if tf.num_tokens == 0:
        return np.zeros(0, dtype=tf.dtype)
    if tf.layout is Layout.MEGATRON:
        _check_contiguous(tf)
    return np.memmap(tf.data, dtype=tf.dtype, mode="r", offset=tf.offset, shape=(tf.num_tokens,))


# ---------------------------------------------------------------- hetc header


def write_hetc_header(f: BinaryIO, header: JsonObject) -> None:
    """Write the magic, the offset and `header` as JSON at the start of `f` (which is then at the ids)."""
    body = json.dumps({"format": "hetc-tokens", "version": 1, **header}, sort_keys=True).encode()
    room = HETC_OFFSET - len(HETC_MAGIC) - 4
    if len(body) > room:
        raise TokenFileError(f"the token file header needs {len(body)} bytes; it has room for {room}")
    f.seek(0)
    f.write(HETC_MAGIC + struct.pack("<I", HETC_OFFSET) + body + b" " * (room - len(body)))


def _inspect_hetc(path: Path, dtype: TokenDType | None) -> TokenFile:
    with open(path, "rb") as f:
        f.seek(len(HETC_MAGIC))
        (offset,) = struct.unpack("<I", f.read(4))
        raw = f.read(max(0, offset - len(HETC_MAGIC) - 4))
    try:
        header = json.loads(raw.decode())
        stored = TokenDType(header["dtype"])
        vocab, count = int(header["vocab"]), int(header["tokens"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise TokenFileError(f"'{path}' has a broken hetc token header ({err})") from None
    if dtype is not None and dtype is not stored:
        raise TokenFileError(f"dtype = {dtype.value}, but the header of '{path}' says its ids are "
                             f"{stored.value}")
    width = np.dtype(_WIDTH[stored]).itemsize
    if path.stat().st_size != offset + count * width:
        raise TokenFileError(f"'{path}' should hold {count} {stored.value} ids after its header "
                             f"({offset + count * width} bytes) but has {path.stat().st_size} bytes: "
                             "was it cut short?")
    return TokenFile(Layout.HETC, path, offset, _WIDTH[stored], count, vocab, header.get("tokenizer"),
                     tokenizer_sha256=header.get("tokenizer_sha256"))


# ---------------------------------------------------------------- Megatron


def _megatron_prefix(path: Path) -> Path | None:
    """PREFIX when `path` names a Megatron pair (PREFIX, PREFIX.bin or PREFIX.idx), else None."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if path.suffix == ".idx" or (idx.is_file() and (path.suffix == ".bin" or not path.is_file())):
        if not bin_.is_file():
            raise TokenFileError(f"the Megatron index '{idx}' has no data file '{bin_}' beside it")
        if not idx.is_file():
            raise TokenFileError(f"cannot find the Megatron index '{idx}'")
        return prefix
    return None


def _inspect_megatron(prefix: Path, dtype: TokenDType | None) -> TokenFile:
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    with open(idx, "rb") as f:
        head = f.read(len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8)
    if len(head) < len(MEGATRON_MAGIC) + 25 or not head.startswith(MEGATRON_MAGIC):
        raise TokenFileError(f"'{idx}' is not a Megatron index (no {MEGATRON_MAGIC!r} header)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MEGATRON_MAGIC):])
    if version != 1:
        raise TokenFileError(f"'{idx}' is version {version} of Megatron's index; hetc reads version 1")
    stored = _MEGATRON_CODES.get(code)
    if stored is None:
        raise TokenFileError(f"'{idx}' stores {_CODE_NAMES.get(code, f'code {code}')} ids; hetc reads uint16 "
                             "(code 8) and int32 (code 4)")
    if dtype is not None and _WIDTH[dtype] != stored.replace("int32", "uint32"):
        raise TokenFileError(f"dtype = {dtype.value}, but '{idx}' says its ids are {stored}")
    width = np.dtype(stored).itemsize
    size = bin_.stat().st_size
    if size % width:
        raise TokenFileError(f"'{bin_}' has {size} bytes, not a whole number of {stored} ids")
    need = len(head) + sequences * (4 + 8) + documents * 8
    if idx.stat().st_size < need:
        raise TokenFileError(f"'{idx}' lists {sequences} sequences and {documents} document indices "
                             f"({need} bytes) but has {idx.stat().st_size} bytes")
    return TokenFile(Layout.MEGATRON, bin_, 0, stored, size // width, index=idx)


def _megatron_arrays(idx: Path, sequences: int) -> tuple[np.ndarray, np.ndarray]:
    start = len(MEGATRON_MAGIC) + 25
    lengths = np.memmap(idx, dtype="<i4", mode="r", offset=start, shape=(sequences,))
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=start + 4 * sequences, shape=(sequences,))
    return lengths, pointers


def _check_contiguous(tf: TokenFile) -> None:
    """The sequences must lie back to back from byte 0 and fill the .bin (Note [Token file layouts])."""
    assert tf.index is not None, "a Megatron TokenFile names its index"
    with open(tf.index, "rb") as f:
        f.seek(len(MEGATRON_MAGIC) + 9)
        (sequences,) = struct.unpack("<Q", f.read(8))
    if sequences == 0:
        return
    lengths, pointers = _megatron_arrays(tf.index, sequences)
    width = np.dtype(tf.dtype).itemsize
    ends = np.cumsum(lengths, dtype=np.int64) * width
    starts_ok = pointers[0] == 0 and np.array_equal(pointers[1:], ends[:-1])
    if not starts_ok or int(ends[-1]) != tf.num_tokens * width:
        raise TokenFileError(f"the sequences of '{tf.index}' do not lie back to back in '{tf.data}'; hetc "
                             "reads a Megatron dataset as one stream of ids")


def write_megatron_index(idx: Path, dtype: TokenDType, doc_lengths: list[int]) -> None:
    """PREFIX.idx for a .bin holding `doc_lengths` documents back to back, one sequence each."""
    stored = "int32" if dtype is TokenDType.UINT32 else "uint16"
    code = next(c for c, name in _MEGATRON_CODES.items() if name == stored)
    lengths = np.asarray(doc_lengths, dtype="<i4")
    width = np.dtype(stored).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1] * width]).astype("<i8")
    documents = np.arange(len(lengths) + 1, dtype="<i8")
    with open(idx, "wb") as f:
        f.write(MEGATRON_MAGIC + struct.pack("<QBQQ", 1, code, len(lengths), len(documents)))
        f.write(lengths.tobytes())
        f.write(pointers[:len(lengths)].tobytes())
        f.write(documents.tobytes())
