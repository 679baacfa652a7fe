"""One module per `hetc` verb; see `hetc.cli.VERBS`."""

import argparse
from typing import TypeAlias

__all__ = ["Subparsers"]

# what each verb's `register` adds its parser to (`hetc.cli.build_parser`); a string, since argparse's
# action is generic only in the type stubs
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
