"""`hetc export hf CHECKPOINT -o DIR`: a checkpoint of any plan as a Hugging Face model directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.commands.argtypes import finite_number

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("export", help="write a checkpoint in another system's format",
                       description="Write a checkpoint (a step-N folder of `hetc run --checkpoint DIR`, "
                                   "saved under any plan) in another system's format.")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    h = formats.add_parser("hf", help="config.json and sharded safetensors with Hugging Face names",
                           description="Write DIR/config.json, DIR/model-NNNNN-of-NNNNN.safetensors, "
                                       "DIR/model.safetensors.index.json, DIR/generation_config.json and the "
                                       "tokenizer files of the Hugging Face directory the model was trained "
                                       "from, which transformers' from_pretrained and "
                                       "AutoTokenizer.from_pretrained load.")
    h.add_argument("checkpoint", metavar="CHECKPOINT", help="a step-N checkpoint folder")
    h.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the Hugging Face directory to write: a new or empty directory, or an earlier export "
                        "(replaced whole); never one holding a file hetc did not write, such as a downloaded model")
    h.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the written tensors (default fp32, the master weights)")
    h.add_argument("--max-shard-size", type=finite_number, default=2.0, metavar="GB",
                   help="largest shard in GiB (default 2)")
    h.set_defaults(func=_hf)


def _hf(args: argparse.Namespace) -> int:
    from hetc.ir.errors import UsageError
    from hetc.hf.config import HfError
    from hetc.runtime.checkpoint_files import CheckpointError
    from hetc.runtime.hf_export import export_hf
    from hetc.ir.spec import DType

    if args.max_shard_size <= 0:
        raise UsageError("--max-shard-size must be positive")
    try:
        exported = export_hf(Path(args.checkpoint), Path(args.output), dtype=DType(args.dtype),
                             max_shard_bytes=int(args.max_shard_size * (1 << 30)))
    except HfError as err:
        raise UsageError(str(err)) from None
    except CheckpointError as err:      # a corrupt or truncated file: located, Note [Checkpoint checksums]
        print(err.render(), file=sys.stderr)
        return 2
    print(f"wrote {args.output}: config.json, generation_config.json, {len(exported.shards)} safetensors "
          f"shard(s)" + (f" and the tokenizer ({', '.join(exported.tokenizer_files)})" if exported.tokenizer_files
                         else ""))
    if not exported.tokenizer_files:   # Note [A complete export]
        print(f"note: no tokenizer: the checkpoint holds no tokenizer files (its model was not read from a "
              f"Hugging Face directory that had them); copy those it was trained with into {args.output}")
    return 0
