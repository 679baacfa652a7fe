"""The lark grammar of the .het language (installed as `hetc.grammar`)."""

from pathlib import Path

__all__ = ["GRAMMAR_PATH"]

GRAMMAR_PATH = Path(__file__).with_name("hetc.lark")
