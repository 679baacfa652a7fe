"""Token files: the layouts `data tokens` reads and `hetc data prepare` writes (torch-free).

Note [Token file layouts]
Every layout is, to hetc, one stream of token ids read a window at a time
(never whole in memory; Note [reading a file that may shrink] in
hetc/ir/tokenstream.py); sequence windows are cut from the stream
(runtime/data.py).

- raw (nanoGPT): the file is nothing but the ids, little-endian uint16 or
  uint32; `dtype` in the spec says which, or a sidecar FILE.json beside it
  (the hetc header's JSON object, see below) does; where both do, they must
  agree. Without a sidecar the ids are checked against the dtype
  (Note [raw ids that contradict their dtype]).
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
  back are an error. `hetc data prepare --megatron` also writes the sidecar
  PREFIX.bin.json, which records the vocabulary and tokenizer (as a hetc
  header does).

Note [raw ids that contradict their dtype]
A raw file says nothing of its width, and a wrong `dtype` reads without
error: uint32 ids read as uint16 give a stream in which every other id is 0
(finding 8 of issue 28); uint16 ids read as uint32 give ids far beyond any
vocabulary. So a raw file without a sidecar must have a size that is a
whole number of ids; read as uint16, its first ids must not be 0 at every
odd position while the even ones are not (how small little-endian uint32
ids look as uint16: no real text has id 0 every other token); and a
sample of its ids (the first, middle and last `SAMPLE_IDS`, so a file of
any size is checked in milliseconds) must lie below the model's vocabulary
(`check_vocab`, also applied to files with a header).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hetc.ir.jsontypes import JsonObject, RawJson
from hetc.ir.spec import TokenDType
from hetc.ir.tokenstream import TokenStream
from hetc.ir.userfile import regular_file_problem

__all__ = [
    "HETC_MAGIC",
    "HETC_OFFSET",
    "MEGATRON_MAGIC",
    "SAMPLE_IDS",
    "Layout",
    "TokenFile",
    "TokenFileError",
    "check_vocab",
    "dtype_for_vocab",
    "fits",
    "inspect_tokens",
    "looks_binary",
    "open_tokens",
    "sidecar_path",
    "tokenizer_digest",
    "write_hetc_header",
    "write_megatron_index",
    "write_sidecar",
]

HETC_MAGIC = b"HETCTOK\x00"
HETC_OFFSET = 4096            # where `prepare` puts the first id: a page, room for the JSON
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_CODES = {8: "uint16", 4: "int32"}
_CODE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
               8: "uint16"}
_WIDTH = {TokenDType.UINT16: "uint16", TokenDType.UINT32: "uint32"}
SAMPLE_IDS = 1 << 16        # ids read from each of the start, middle and end (Note [raw ids that contradict ...])
_MIN_PAIRS = 16             # uint16 pairs needed before "every odd id is 0" says anything


class TokenFileError(ValueError):
    """A token file hetc cannot read as its spec says; the message is for the user.

    `field`: the key of the data block the message is about (`dtype` or `path`), where it is located.
    """

    def __init__(self, message: str, field: str = "path") -> None:
        super().__init__(message)
        self.field = field


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
    problem = regular_file_problem(path, "token file")
    if problem:
        raise TokenFileError(problem)
    with open(path, "rb") as f:
        head = f.read(len(HETC_MAGIC))
    if head == HETC_MAGIC:
        return _inspect_hetc(path, dtype)
    return _inspect_raw(path, dtype)


def open_tokens(tf: TokenFile) -> TokenStream:
    """The file's ids, read a window at a time (Note [reading a file that may shrink])."""
    return TokenStream.of_file(tf.data, tf.dtype, tf.offset, tf.num_tokens)


def check_vocab(tf: TokenFile, vocab: int) -> None:
    """TokenFileError when a sample of the file's ids (Note [raw ids that contradict their dtype]) holds one
    that is not below `vocab`."""
    for first, ids in _samples(tf):
        beyond = np.flatnonzero(ids >= vocab)
        if beyond.size == 0:
            continue
        at, value = first + int(beyond[0]), int(ids[beyond[0]])
        message = f"'{tf.data}' holds the id {value} at token {at}, outside the model's vocab = {vocab}"
        if tf.layout is Layout.RAW and tf.dtype == "uint32" and value > 0xFFFF:
            raise TokenFileError(f"{message}; uint16 ids read as uint32 look like this: is it dtype = uint16?",
                                 field="dtype")
        raise TokenFileError(message)


def _samples(tf: TokenFile) -> Iterator[tuple[int, np.ndarray]]:
    """(index of the first, ids) of the start, the middle and the end of the file, at most SAMPLE_IDS each."""
    ids = open_tokens(tf)
    starts = sorted({0, max(0, (tf.num_tokens - SAMPLE_IDS) // 2), max(0, tf.num_tokens - SAMPLE_IDS)})
    for start in starts:
        yield start, np.asarray(ids[start:start + SAMPLE_IDS])


# ---------------------------------------------------------------- raw ids and their sidecar


def sidecar_path(data: Path) -> Path:
    """Where the sidecar of the ids in `data` is: FILE.json beside it."""
    return data.with_name(data.name + ".json")


def write_sidecar(data: Path, header: JsonObject) -> None:
    """What a hetc header records, for a file of ids without one (a Megatron .bin, raw ids)."""
    sidecar_path(data).write_text(json.dumps({"format": "hetc-tokens", "version": 1, **header},
                                             sort_keys=True, indent=1) + "\n")


def _read_sidecar(data: Path) -> dict[str, RawJson] | None:
    """The sidecar of `data` (None: it has none); TokenFileError when it is not one."""
    path = sidecar_path(data)
    if not path.is_file():
        return None
    try:
        header: dict[str, RawJson] = json.loads(path.read_text())
        TokenDType(header["dtype"])
        int(header["vocab"]), int(header["tokens"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise TokenFileError(f"'{path}' is not the sidecar of a token file ({type(err).__name__}: {err})") from None
    return header


def _inspect_raw(path: Path, dtype: TokenDType | None) -> TokenFile:
    sidecar = _read_sidecar(path)
    if sidecar is None:
        return _inspect_bare(path, dtype)
    stored = TokenDType(sidecar["dtype"])
    if dtype is not None and dtype is not stored:
        raise TokenFileError(f"dtype = {dtype.value}, but '{sidecar_path(path)}' says the ids of '{path}' are "
                             f"{stored.value}", field="dtype")
    count, width = int(sidecar["tokens"]), np.dtype(_WIDTH[stored]).itemsize
    if path.stat().st_size != count * width:
        raise TokenFileError(f"'{sidecar_path(path)}' says '{path}' holds {count} {stored.value} ids "
                             f"({count * width} bytes), but it has {path.stat().st_size} bytes")
    return TokenFile(Layout.RAW, path, 0, _WIDTH[stored], count, int(sidecar["vocab"]), sidecar.get("tokenizer"),
                     tokenizer_sha256=sidecar.get("tokenizer_sha256"))


def _inspect_bare(path: Path, dtype: TokenDType | None) -> TokenFile:
    """Raw ids with nothing to say their width but the spec (Note [raw ids that contradict their dtype])."""
    if dtype is None:
        raise TokenFileError(f"'{path}' has no header, so it is read as raw ids (nanoGPT's layout): "
                             "say how wide they are with dtype = uint16 or uint32")
    width = np.dtype(_WIDTH[dtype]).itemsize
    size = path.stat().st_size
    if size % width:
        raise TokenFileError(f"'{path}' has {size} bytes, not a whole number of {dtype.value} ids", field="dtype")
    tf = TokenFile(Layout.RAW, path, 0, _WIDTH[dtype], size // width)
    if dtype is TokenDType.UINT16 and _looks_like_uint32(np.asarray(open_tokens(tf)[:SAMPLE_IDS])):
        raise TokenFileError(f"'{path}' read as uint16 has the id 0 at every odd position of its first ids and "
                             "others between them: that is how uint32 ids look as uint16; is it dtype = uint32?",
                             field="dtype")
    return tf


def _looks_like_uint32(ids: np.ndarray) -> bool:
    """Whether uint16 `ids` are little-endian uint32 ids below 65536: every high half 0, the low ones not."""
    pairs = ids[:len(ids) // 2 * 2].reshape(-1, 2)
    return len(pairs) >= _MIN_PAIRS and not pairs[:, 1].any() and bool(pairs[:, 0].any())


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
                             f"{stored.value}", field="dtype")
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
        raise TokenFileError(f"dtype = {dtype.value}, but '{idx}' says its ids are {stored}", field="dtype")
    need = len(head) + sequences * (4 + 8) + documents * 8
    if idx.stat().st_size < need:
        raise TokenFileError(f"'{idx}' lists {sequences} sequences and {documents} document indices "
                             f"({need} bytes) but has {idx.stat().st_size} bytes")
    width = np.dtype(stored).itemsize
    size = bin_.stat().st_size
    if size % width:
        raise TokenFileError(f"'{bin_}' has {size} bytes, not a whole number of {stored} ids")
    _check_contiguous(idx, bin_, width, sequences)
    sidecar = _read_sidecar(bin_) or {}
    if sidecar and sidecar["dtype"] != stored.replace("int32", "uint32"):
        raise TokenFileError(f"'{sidecar_path(bin_)}' says the ids of '{bin_}' are {sidecar['dtype']}, but "
                             f"'{idx}' says {stored}: are they of two different datasets?")
    vocab = int(sidecar["vocab"]) if sidecar else None
    return TokenFile(Layout.MEGATRON, bin_, 0, stored, size // width, vocab, sidecar.get("tokenizer"), index=idx,
                     tokenizer_sha256=sidecar.get("tokenizer_sha256"))


def _check_contiguous(idx: Path, bin_: Path, width: int, sequences: int) -> None:
    """The sequences must lie back to back from byte 0 and fill the .bin (Note [Token file layouts]); the
    message says where they first do not."""
    start = len(MEGATRON_MAGIC) + 25
    lengths = np.fromfile(idx, dtype="<i4", offset=start, count=sequences)
    pointers = np.fromfile(idx, dtype="<i8", offset=start + 4 * sequences, count=sequences)
    if (lengths < 0).any():
        first = int(np.flatnonzero(lengths < 0)[0])
        raise TokenFileError(f"sequence {first} of '{idx}' has the length {int(lengths[first])}: is the index "
                             "broken?")
    ends = np.cumsum(lengths, dtype=np.int64) * width
    total = int(ends[-1]) if sequences else 0
    size = bin_.stat().st_size
    if total != size:
        why = "was it cut short?" if size < total else "is the index of another .bin?"
        raise TokenFileError(f"'{idx}' says its {sequences} sequences hold {total // width} ids ({total} "
                             f"bytes), but '{bin_}' has {size} bytes: {why}")
    if sequences == 0:
        return
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])
    moved = np.flatnonzero(pointers != starts)
    if moved.size:
        i = int(moved[0])
        after = f"sequence {i - 1} ends at byte {int(starts[i])}" if i else "the file starts at byte 0"
        raise TokenFileError(f"sequence {i} of '{idx}' starts at byte {int(pointers[i])} of '{bin_}', but {after}: "
                             "the sequences do not lie back to back, and hetc reads a Megatron dataset as one "
                             "stream of ids (Megatron's preprocess_data.py and `hetc data prepare --megatron` "
                             "write them so)")


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
