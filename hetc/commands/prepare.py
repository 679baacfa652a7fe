"""`hetc data prepare`: documents -> token ids, with a Hugging Face tokenizer, into a token file.

Inputs by suffix: `.jsonl` / `.json` / `.ndjson` are JSON lines (one object a
line, its text in a field, `text` by default), `.parquet` is read a batch of
rows at a time (pyarrow), anything else is plain text, one document a file,
tokenized a chunk of whole lines at a time so that no file sits whole in
memory. Each document's ids are the tokenizer's encoding without special
tokens (the pre-training convention of nanoGPT and Megatron), then EOS.
Out comes the hetc layout (Note [Token file layouts] in hetc/ir/tokenfile.py)
or, with `megatron`, a Megatron PREFIX.bin / PREFIX.idx pair, one sequence
per document, and the sidecar PREFIX.bin.json recording what a hetc header
would (dtype, vocabulary, tokenizer, token count), which `hetc check` holds
the model and the spec's `dtype` to.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from hetc.ir.jsontypes import JsonObject, RawJson
from hetc.ir.spec import TokenDType
from hetc.ir.userfile import regular_file_problem
from hetc.ir.tokenfile import (dtype_for_vocab, fits, sidecar_path, tokenizer_digest, write_hetc_header,
                            write_megatron_index, write_sidecar)

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

__all__ = ["PrepareError", "Prepared", "Tokenizer", "load_tokenizer", "prepare"]

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_BATCH_BYTES = 1 << 20      # documents tokenized together (encode_batch runs them in parallel)
_CHUNK_LINES = 4096         # plain text: lines per chunk


class PrepareError(ValueError):
    """A bad input, tokenizer or option; the message says which and what to do."""


@dataclass(frozen=True)
class Tokenizer:
    encoder: HFTokenizer
    name: str              # the tokenizer directory's name
    sha256: str            # of tokenizer.json: which tokenizer made a file
    vocab: int             # ids 0..vocab-1, added tokens included
    eos: int


@dataclass(frozen=True)
class Prepared:
    paths: tuple[Path, ...]
    documents: int
    tokens: int
    dtype: TokenDType


def load_tokenizer(directory: Path, eos: str | None = None) -> Tokenizer:
    """DIR/tokenizer.json, with EOS named by `eos` or by the directory's configuration files."""
    from tokenizers import Tokenizer as HFTokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise PrepareError(f"no tokenizer.json in '{directory}' (a Hugging Face tokenizer directory has one)")
    try:
        encoder = HFTokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for broken files
        raise PrepareError(f"cannot load '{path}': {err}") from None
    token = eos if eos is not None else _configured_eos(directory)
    if token is None:
        raise PrepareError(f"'{directory}' names no EOS token (eos_token in tokenizer_config.json or "
                           "special_tokens_map.json, eos_token_id in config.json); name it with --eos TOKEN")
    vocab = encoder.get_vocab_size(with_added_tokens=True)
    eos_id = token if isinstance(token, int) else encoder.token_to_id(token)
    if eos_id is None or not 0 <= eos_id < vocab:    # an id beyond it would be written into every document
        raise PrepareError(f"the EOS token '{token}' is not in the vocabulary of '{path}' ({vocab} tokens)")
    return Tokenizer(encoder, directory.resolve().name, tokenizer_digest(directory), vocab, int(eos_id))


def _configured_eos(directory: Path) -> str | int | None:
    for name, key in (("tokenizer_config.json", "eos_token"), ("special_tokens_map.json", "eos_token"),
                      ("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id")):
        value = _read_json(directory / name).get(key)
        if isinstance(value, dict):        # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, list):        # several EOS ids: the first ends documents
            value = value[0] if value else None
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return value
    return None


def _read_json(path: Path) -> dict[str, RawJson]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


# ---------------------------------------------------------------- documents


def documents(path: Path, field: str = "text") -> Iterator[tuple[str, int]]:
    """(document, bytes of `path` read so far) for each document of one input file."""
    problem = regular_file_problem(path, "input")
    if problem:
        raise PrepareError(problem)
    if path.suffix in JSON_SUFFIXES:
        yield from _json_lines(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        yield from _plain_text(path)


def _json_lines(path: Path, field: str) -> Iterator[tuple[str, int]]:
    done = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            done += len(raw)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as err:
                raise PrepareError(f"{path}:{lineno}: not a JSON line ({err})") from None
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
                raise PrepareError(f"{path}:{lineno}: no text field '{field}' (it has {keys}); choose the "
                                   "field with --field NAME")
            yield _text(obj[field], f"{path}:{lineno}: the field '{field}'"), done


def _text(value: RawJson, what: str) -> str:
    """A document's text as the tokenizer takes it: a string UTF-8 can encode (JSON's \\ud800 escapes can
    name a lone surrogate, which it cannot)."""
    if not isinstance(value, str):
        raise PrepareError(f"{what} holds {'null' if value is None else type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PrepareError(f"{what} holds a lone surrogate ({value[err.start]!a}) at character {err.start}, "
                           "which is not text") from None
    return value


def _parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no type stubs
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise PrepareError(f"reading the Parquet file '{path}' needs pyarrow: pip install pyarrow "
                           "(or pip install 'hetc[parquet]')") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors for a broken file have no common base
        raise PrepareError(f"cannot read the Parquet file '{path}': {err}") from None
    if field not in table.schema_arrow.names:
        raise PrepareError(f"{path}: no column '{field}' (it has {', '.join(table.schema_arrow.names)}); "
                           "choose it with --field NAME")
    kind = table.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PrepareError(f"{path}: the column '{field}' holds {kind}, not text; choose a text column with "
                           "--field NAME")
    size, rows, total = path.stat().st_size, 0, max(1, table.metadata.num_rows)
    for batch in table.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            rows += 1
            if text is not None:
                yield text, size * rows // total


def _plain_text(path: Path) -> Iterator[tuple[str, int]]:
    """One document: yielded as chunks of whole lines; `prepare` joins their ids (EOS after the last)."""
    done = 0
    with open(path, encoding="utf-8", errors="strict", newline="") as f:
        while True:
            lines = [line for _, line in zip(range(_CHUNK_LINES), f)]
            if not lines:
                return
            chunk = "".join(lines)
            done += len(chunk.encode())
            yield chunk, done


# ---------------------------------------------------------------- writing


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per tenth elsewhere."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.stream, self.width = max(1, total_bytes), stream or sys.stderr, width
        self.tty = self.stream.isatty()
        self.shown = -1

    def update(self, done_bytes: int, docs: int, tokens: int, final: bool = False) -> None:
        percent = min(100, 100 * done_bytes // self.total)
        step = percent if self.tty else percent // 10 * 10
        if step == self.shown and not (final and self.tty):   # a terminal's last redraw ends the line
            return
        self.shown = step
        filled = self.width * percent // 100
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {percent:3d}%  {done_bytes / 1e6:,.1f}/" \
              f"{self.total / 1e6:,.1f} MB  {docs:,} documents  {tokens:,} tokens"
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + bar + end)
        self.stream.flush()


def prepare(inputs: Iterable[Path], tok: Tokenizer, out: Path, *, field: str = "text",
            dtype: TokenDType | None = None, megatron: bool = False, progress: Progress | None = None) -> Prepared:
    """Tokenize every document of `inputs` into `out` (written whole or not at all)."""
    inputs = list(inputs)
    dtype = dtype or dtype_for_vocab(tok.vocab)
    if not fits(dtype, tok.vocab):
        raise PrepareError(f"--dtype {dtype.value} holds ids below {np.iinfo(dtype.value).max + 1}, but the "
                           f"tokenizer '{tok.name}' has {tok.vocab} tokens: use --dtype uint32")
    width = np.dtype("int32" if megatron and dtype is TokenDType.UINT32 else dtype.value)
    data_path = out.with_name(out.name + ".bin") if megatron else out
    tmp = data_path.with_name(f".{data_path.name}.tmp")
    progress = progress or Progress(sum(p.stat().st_size for p in inputs if p.is_file()))
    lengths: list[int] = []
    try:
        with open(tmp, "wb") as f:
            if not megatron:
                write_hetc_header(f, _header(tok, dtype, 0, 0))
            little = width.newbyteorder("<")
            f.writelines(ids.astype(little).tobytes() for ids in _encoded(inputs, tok, field, progress, lengths))
            tokens = sum(lengths)
            progress.update(progress.total, len(lengths), tokens, final=True)
            if not lengths:
                raise PrepareError("the inputs hold no documents")
            if not megatron:
                write_hetc_header(f, _header(tok, dtype, len(lengths), tokens))
        if megatron:
            write_megatron_index(out.with_name(out.name + ".idx"), dtype, lengths)
            write_sidecar(data_path, _header(tok, dtype, len(lengths), tokens))
        os.replace(tmp, data_path)
    finally:
        tmp.unlink(missing_ok=True)
    paths = (data_path, out.with_name(out.name + ".idx"), sidecar_path(data_path)) if megatron else (data_path,)
    return Prepared(paths, len(lengths), tokens, dtype)


def _header(tok: Tokenizer, dtype: TokenDType, docs: int, tokens: int) -> JsonObject:
    return {"dtype": dtype.value, "vocab": tok.vocab, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256,
            "eos": tok.eos, "documents": docs, "tokens": tokens}


def _encoded(inputs: list[Path], tok: Tokenizer, field: str, progress: Progress,
             lengths: list[int]) -> Iterator[np.ndarray]:
    """Every document's ids, EOS after each (a plain-text file's come in chunks); appends the documents'
    lengths to `lengths`."""
    base = 0
    for path in inputs:
        plain = path.suffix not in JSON_SUFFIXES and path.suffix != ".parquet"
        in_doc, done = 0, 0     # ids of the plain-text document so far
        for batch, done in _batches(documents(path, field)):
            for enc in tok.encoder.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids if plain else [*enc.ids, tok.eos], dtype=np.int64)
                if plain:
                    in_doc += len(ids)
                else:
                    lengths.append(len(ids))
                yield ids
            progress.update(base + done, len(lengths), sum(lengths) + in_doc)
        if plain:
            lengths.append(in_doc + 1)
            yield np.asarray([tok.eos], dtype=np.int64)
        base += done


def _batches(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    """Documents in batches of about _BATCH_BYTES characters, with the input's bytes read after each."""
    batch: list[str] = []
    size = done = 0
    for text, done in docs:
        batch.append(text)
        size += len(text)
        if size >= _BATCH_BYTES:
            yield batch, done
            batch, size = [], 0
    if batch:
        yield batch, done
