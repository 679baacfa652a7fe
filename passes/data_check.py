"""Validation of the training and evaluation data: files that exist and fit the model.

Part of the validation pass (passes/validate.py). A text file must be text,
a token file must be readable as its block says (hetc/ir/tokenfile.py), its
ids must fit the model's vocabulary, and evaluation must have data to read.
Files are looked at only when the spec's directory is known (`base_dir`):
their headers (a Megatron index whole), and a bounded sample of the ids of
a token file, which must fit both its `dtype` and the model's vocabulary
(Note [raw ids that contradict their dtype] in hetc/ir/tokenfile.py). The run
checks the same again when it starts (runtime/data.py).
"""

from __future__ import annotations

from pathlib import Path

from hetc.ir.errors import Diagnostic
from hetc.passes.validate_runtime import check_text_vocab
from hetc.ir.spec import DataFileSpec, DataKind, DataSpec, ModelSpec, TokenDType, TrainSpec
from hetc.ir.userfile import regular_file_problem
from hetc.ir.tokenfile import (TokenFile, TokenFileError, check_vocab, fits, inspect_tokens, looks_binary,
                            tokenizer_digest)

__all__ = ["check_data"]


def check_data(model: ModelSpec | None, t: TrainSpec, base_dir: Path | None, errors: list[Diagnostic]) -> None:
    """Diagnostics of the train block `t`'s data and eval data (for `model`, where the spec has one)."""
    for data in filter(None, (t.data, t.eval)):
        _check_blend(data, errors)
        for file in data.files():
            _check_source(file, model, base_dir, errors)
    if model is not None and (problem := check_text_vocab(model, t)) is not None:
        errors.append(Diagnostic(model.span_of("vocab"), problem))
    _check_eval(t, errors)


def _check_blend(data: DataSpec, errors: list[Diagnostic]) -> None:
    """A blend is of text and token files, each with a weight that draws from it (Note [Blends] in
    runtime/data.py); source blocks are a blend's."""
    if data.kind is not DataKind.BLEND:
        if data.sources:
            errors.append(Diagnostic(data.sources[0].span, f"source blocks are a blend's (data blend {{ ... }}); "
                                     f"data {data.kind.value} reads one file"))
        return
    if not data.sources:
        errors.append(Diagnostic(data.span, "data blend needs source blocks, each a text or token file with its "
                                 "weight: source tokens { path = \"web.bin\", weight = 0.7 }"))
    for key in ("path", "dtype", "tokenizer", "shuffle"):
        if data.written(key):
            errors.append(Diagnostic(data.span_of(key), f"data blend reads its sources' files: {key} belongs in "
                                     "each source block"))
    for source in data.sources:
        if source.kind not in (DataKind.TEXT, DataKind.TOKENS):
            errors.append(Diagnostic(source.span, f"a blend's source is a text or token file, not "
                                     f"{source.kind.value}"))
        if source.weight == 0:
            errors.append(Diagnostic(source.span_of("weight"), "weight = 0 never draws from this source; leave "
                                     "the source out"))


def _check_source(data: DataFileSpec, model: ModelSpec | None, base_dir: Path | None, errors: list[Diagnostic]) -> None:
    if data.kind is DataKind.SYNTHETIC:
        return
    if not data.path:
        example = "file.txt" if data.kind is DataKind.TEXT else "tokens.bin"
        errors.append(Diagnostic(data.span, f"data {data.kind.value} needs a path = \"{example}\""))
        return
    if model is not None and data.dtype is TokenDType.UINT16 and not fits(TokenDType.UINT16, model.vocab):
        errors.append(Diagnostic(data.span_of("dtype"), f"dtype = uint16 holds ids below 65536, too few for the "
                                 f"model's vocab = {model.vocab}: its token files need dtype = uint32"))
    if base_dir is None:
        return
    path = data.resolve(base_dir)
    if data.kind is DataKind.TEXT:
        _check_text(data, path, base_dir, errors)
    else:
        _check_tokens(data, path, model, base_dir, errors)


def _check_text(data: DataFileSpec, path: Path, base_dir: Path, errors: list[Diagnostic]) -> None:
    problem = regular_file_problem(path, "text file", data.path)
    if problem:
        errors.append(Diagnostic(data.span_of("path"), problem + _resolved_hint(data.path, path, base_dir)))
        return
    why = looks_binary(path)
    if why is not None:
        errors.append(Diagnostic(data.span_of("path"), f"'{data.path}' is not a text file: {why}; read token "
                                 "ids with data tokens { path = ..., dtype = uint16 | uint32 }"))


def _resolved_hint(written: str, path: Path, base_dir: Path) -> str:
    """Where a missing relative path was looked for, when that is not where the user stands: a spec's paths
    are read from its own folder, so a plan directory copied elsewhere without its data misses them there."""
    if Path(written).is_absolute() or path.exists() or base_dir.resolve() == Path.cwd().resolve():
        return ""
    return f" (a relative path is read from the spec's folder: here {path.resolve()})"


def _check_tokens(data: DataFileSpec, path: Path, model: ModelSpec | None, base_dir: Path, errors: list[Diagnostic]) -> None:
    try:
        tf = inspect_tokens(path, data.dtype)
        if model is not None and (tf.vocab is None or tf.vocab <= model.vocab):   # else: said below
            check_vocab(tf, model.vocab)
    except TokenFileError as err:
        errors.append(Diagnostic(data.span_of(err.field), str(err)))
        return
    except OSError as err:
        errors.append(Diagnostic(data.span_of("path"), f"cannot read the token file '{data.path}': {err.strerror}"))
        return
    if model is not None and tf.vocab is not None and tf.vocab > model.vocab:
        made_by = f" by the tokenizer '{tf.tokenizer}'" if tf.tokenizer else ""
        errors.append(Diagnostic(data.span_of("path"), f"'{data.path}' was written{made_by} with a vocabulary of "
                                 f"{tf.vocab}, larger than the model's vocab = {model.vocab}"))
    if data.tokenizer:
        _check_tokenizer(data, tf, base_dir, errors)
    if model is not None and tf.num_tokens < model.seq + 1:
        errors.append(Diagnostic(data.span_of("path"), f"'{data.path}' holds {tf.num_tokens} tokens; a sequence "
                                 f"of seq = {model.seq} needs {model.seq + 1}"))


def _check_tokenizer(data: DataFileSpec, tf: TokenFile, base_dir: Path, errors: list[Diagnostic]) -> None:
    """The tokenizer the spec names must be the one a hetc header says wrote the file."""
    where = data.span_of("tokenizer")
    try:
        digest = tokenizer_digest(data.resolve(base_dir, data.tokenizer))
    except OSError as err:
        errors.append(Diagnostic(where, f"cannot read '{data.tokenizer}/tokenizer.json': {err.strerror}"))
        return
    if tf.tokenizer_sha256 is None:
        errors.append(Diagnostic(where, f"'{data.path}' records no tokenizer (only `hetc data prepare`'s files "
                                 "do); leave tokenizer out for it"))
    elif tf.tokenizer_sha256 != digest:
        errors.append(Diagnostic(where, f"'{data.path}' was written by the tokenizer '{tf.tokenizer}', not by "
                                 f"'{data.tokenizer}' (their tokenizer.json differ)"))


def _check_eval(t: TrainSpec, errors: list[Diagnostic]) -> None:
    if t.eval is not None and t.eval_share > 0:
        errors.append(Diagnostic(t.span_of("eval_share"), "give validation data either as an eval block or as "
                                 "eval_share of the training data, not both"))
    elif t.eval_share > 0 and t.data.kind is DataKind.SYNTHETIC:
        errors.append(Diagnostic(t.span_of("eval_share"), "eval_share holds out part of a text or token file; "
                                 "synthetic data has none (use an eval block)"))
    elif t.eval_every > 0 and t.eval is None and t.eval_share == 0:
        errors.append(Diagnostic(t.span_of("eval_every"), "eval_every needs validation data: an eval block "
                                 "(eval tokens { path = ... }) or eval_share = 0.01 of the training data"))
