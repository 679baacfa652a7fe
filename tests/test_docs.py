"""docs/ stays true to the code: generated parts are current, examples parse."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from hetc.frontend import syntax
from hetc.frontend.convert import fields_of, to_spec
from hetc.ir.errors import Span
from hetc.ir.spec import Spec
from tests.conftest import ROOT

DOCS = ROOT / "docs"


def _load(script: str):
    spec = importlib.util.spec_from_file_location(script, DOCS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_language_md_key_tables_are_current():
    text = (DOCS / "language.md").read_text()
    assert _load("gen_language").render(text) == text, "run python docs/gen_language.py"


def test_errors_md_is_current():
    assert _load("gen_errors").render() == (DOCS / "errors.md").read_text(), "run python docs/gen_errors.py"


def _node_classes(cls: type, seen: set[type]) -> set[type]:
    seen.add(cls)
    for info in fields_of(cls):
        if dataclasses.is_dataclass(info.base) and info.meta.block and info.base not in seen:
            _node_classes(info.base, seen)
    return seen


def test_every_block_has_a_key_table():
    text = (DOCS / "language.md").read_text()
    missing = [c.__name__ for c in _node_classes(Spec, set()) if f"<!-- generated: keys {c.__name__} -->" not in text]
    assert not missing


_EXAMPLE = re.compile(r"```het\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("number", range(len(_EXAMPLE.findall((DOCS / "language.md").read_text()))))
def test_language_md_examples_parse_and_convert(number):
    example = _EXAMPLE.findall((DOCS / "language.md").read_text())[number]
    items = [i for i in syntax.parse_text(example, "language.md").items if not isinstance(i, syntax.Use)]
    to_spec(items, Span("language.md", 1, 1, 1, 1))


def test_glossary_defines_the_shared_words():
    text = (DOCS / "glossary.md").read_text()
    for word in ("rank", "stage", "lane", "ministage", "microbatch", "group", "N_part", "N_rep", "ZeRO level",
                 "schedule", "offload", "routing"):
        assert re.search(rf"\*\*{re.escape(word)}", text), word


def test_errors_md_covers_every_invalid_case():
    text = (DOCS / "errors.md").read_text()
    cases = [p.name for p in Path(ROOT / "tests" / "invalid").glob("*.het") if not p.name.startswith("_")]
    assert cases, "no invalid cases found"
    assert all(f"`tests/invalid/{name}`" in text for name in cases)


def test_the_readme_quickstart_is_the_demo_and_the_test_command_ci_runs():
    """The quickstart is exactly two commands, one that runs the demo and one that runs the tests, and CI
    runs that same test command."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quickstart\n\n```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md: no ```sh block right under ## Quickstart"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in [line.strip() for line in ci], ".ci/run must run the README's test command"
