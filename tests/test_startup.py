"""What a hetc process imports before its work. Every rank of every run is a process (on every node, and many
times in this suite), so an import its work does not need is paid again and again: the verbs a command line
does not name (Note [one verb's parser] in hetc/cli.py), and torch._dynamo and sympy, which torch imports the
first time an initialiser or empty_like runs on the meta device where layers are built (runtime/nn/layers.py
`_embedding`, runtime/nn/model.py `_materialise`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetc.cli import VERBS, build_parser
from tests.conftest import DEMO, ROOT

# imported only by torch's Python references on the meta device, and by torch.compile, which hetc does not use
NEEDLESS = ("torch._dynamo", "sympy")

# a rank builds every layer of a model's ministages: GPT (learned positions), Llama, MoE and tied models
BUILD = """
import dataclasses, json, sys
import torch
from hetc.frontend.load import load_spec
from hetc.ir.spec import Arch
from hetc.runtime.nn.model import build_ministage
models = [load_spec(path).spec.model for path in sys.argv[1:]]
models.append(dataclasses.replace(models[0], arch=Arch.GPT, kv_heads=None))   # learned positions: two tables
before = set(sys.modules)
for model in models:
    whole = range(model.layers + 2)
    build_ministage(model, whole, seed=1)                    # initialised here
    build_ministage(model, whole, seed=1, initialise=False)  # left on the meta device for a checkpoint
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_building_a_ranks_layers_imports_no_compiler_machinery() -> None:
    specs = [DEMO / name for name in ("single.het", "moe_single.het", "tied_single.het")]
    imported = json.loads(_python(BUILD, *map(str, specs)))
    assert not [name for name in imported if name.startswith(NEEDLESS)], imported


@pytest.mark.parametrize("argv", [["run", "plan", "--local"], ["-v", "fmt", "x.het"], ["import", "hf", "--help"]])
def test_a_command_line_registers_only_the_verb_it_names(argv: list[str]) -> None:
    verb = next(word for word in argv if not word.startswith("-"))
    code = ("import json, sys; from hetc.cli import build_parser; build_parser(sys.argv[1:]); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hetc.commands.'))))")
    verbs = {f"hetc.commands.{name}" for name in VERBS}
    imported = [name for name in json.loads(_python(code, *argv)) if name in verbs]
    assert imported == [f"hetc.commands.{verb}_" if verb == "import" else f"hetc.commands.{verb}"]


@pytest.mark.parametrize("argv", [[], ["--help"], ["rn"], ["--version"], ["import_"]])
def test_without_a_verb_every_verb_is_registered(argv: list[str]) -> None:
    """So that `hetc --help`, usage and an unknown word's "invalid choice" list every verb."""
    sub = next(a for a in build_parser(argv)._actions if a.dest == "verb")
    assert len(sub.choices) == len(VERBS)    # type: ignore[arg-type]


def test_the_parser_of_one_verb_is_that_verbs_parser_in_the_whole_one() -> None:
    whole = next(a for a in build_parser()._actions if a.dest == "verb").choices
    for verb in ("run", "compile", "import"):
        one = next(a for a in build_parser([verb])._actions if a.dest == "verb").choices
        assert list(one) == [verb]   # type: ignore[arg-type]
        assert one[verb].format_help() == whole[verb].format_help()   # type: ignore[index]
