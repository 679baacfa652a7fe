"""`hetc data prepare INPUT... --tokenizer DIR -o OUT`: tokenize documents into a token file."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetc.commands import Subparsers
from hetc.ir.errors import UsageError
from hetc.ir.spec import TokenDType

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("data", help="prepare training data (tokenize text into a token file)",
                       description="Tools for training data. `data tokens { path = OUT }` in a spec reads "
                                   "what `hetc data prepare` writes.")
    tools = p.add_subparsers(dest="tool", metavar="TOOL", required=True)
    q = tools.add_parser(
        "prepare", help="tokenize text, JSON lines or Parquet with a Hugging Face tokenizer",
        description="Tokenize every document of INPUT... with DIR/tokenizer.json (the `tokenizers` package), "
                    "end each with EOS, and write OUT: a token file with a header (dtype, vocabulary size, "
                    "tokenizer) that `data tokens` reads and checks, or a Megatron OUT.bin/OUT.idx pair. "
                    "*.jsonl/*.json/*.ndjson are JSON lines (one document a line, in --field), *.parquet "
                    "is read with pyarrow (if installed), anything else is plain text (one document a file).",
        epilog="example: hetc data prepare corpus.jsonl --tokenizer my-tokenizer/ -o corpus.tok")
    q.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text, JSON lines or Parquet files")
    q.add_argument("--tokenizer", required=True, type=Path, metavar="DIR",
                   help="a Hugging Face tokenizer directory (tokenizer.json and its configuration)")
    q.add_argument("-o", "--output", required=True, type=Path, metavar="OUT",
                   help="the token file (with --megatron: the prefix of OUT.bin and OUT.idx)")
    q.add_argument("--field", default="text", help="the text field of JSON lines / column of Parquet (text)")
    q.add_argument("--eos", metavar="TOKEN",
                   help="the token ending each document (default: the tokenizer configuration's eos_token)")
    q.add_argument("--dtype", choices=[d.value for d in TokenDType],
                   help="id width (default: uint16 when the vocabulary fits, else uint32)")
    q.add_argument("--megatron", action="store_true",
                   help="write Megatron's indexed dataset (OUT.bin + OUT.idx, one sequence per document) and "
                        "OUT.bin.json, which records the vocabulary and tokenizer for `hetc check`")
    q.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from hetc.commands.prepare import PrepareError, load_tokenizer, prepare

    out = args.output
    if args.megatron and out.suffix in (".bin", ".idx"):
        out = out.with_suffix("")
    from hetc.hf.files import model_files
    from hetc.ir.outdir import check_output_file

    reads = [(Path(p), "an input") for p in args.inputs] + [(p, "a file of the tokenizer directory") for p in model_files(args.tokenizer)]
    for path in [out.with_name(out.name + suffix) for suffix in (".bin", ".idx")] if args.megatron else [out]:
        check_output_file(path, "-o", reads)    # Note [output files]
    try:
        tok = load_tokenizer(args.tokenizer, args.eos)
        done = prepare(args.inputs, tok, out, field=args.field, megatron=args.megatron,
                       dtype=TokenDType(args.dtype) if args.dtype else None)
    except PrepareError as err:
        raise UsageError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read the inputs: {err}") from None
    print(f"wrote {done.tokens:,} tokens of {done.documents:,} documents ({done.dtype.value}, vocabulary "
          f"{tok.vocab:,}, tokenizer {tok.name}) -> {', '.join(map(str, done.paths))}")
    return 0
