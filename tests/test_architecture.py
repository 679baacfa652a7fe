"""The layers of docs/architecture.md hold: no import cycle between them, no import against their order.

The page is the one statement of the rule: its layer table (lowest first) and its table of known
exceptions are parsed here. Every `import` and `from ... import` counts, at module level, inside
functions, or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

__all__ = ["Layer", "edges_against_order", "folder_cycles", "import_edges", "layer_cycles"]

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("grammar", "hetc", "passes", "runtime")   # the top-level folders of the code
# hetc.passes, hetc.runtime and hetc.grammar are the folders of these names (Note [layout])
LINKED = {"hetc.passes": "passes", "hetc.runtime": "runtime", "hetc.grammar": "grammar"}
LINKS = {ROOT / "hetc" / name for name in ("passes", "runtime", "grammar")}


@dataclass(frozen=True)
class Layer:
    name: str
    rank: int                  # the row: lower rows may import higher ones
    paths: tuple[str, ...]     # "hetc/frontend/" (a folder) or "hetc/compiler.py" (a module)


def _table(marker: str) -> list[list[str]]:
    """The rows of the markdown table that follows `<!-- marker: ... -->` on the page."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- {marker}:"))
    rows = []
    for line in lines[start + 3:]:   # the comment, the header, the rule
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _paths(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def page_layers() -> list[Layer]:
    return [Layer(row[0], rank, _paths(row[1])) for rank, row in enumerate(_table("layers"))]


def page_exceptions() -> set[tuple[str, str]]:
    return {(_paths(row[0])[0], _paths(row[1])[0]) for row in _table("exceptions")}


def source_files() -> list[Path]:
    """Every module of the code, by its real path (the symlinked packages once)."""
    files = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(link in path.parents for link in LINKS):
                files.append(path)
    return files


def _module_path(module: str) -> str | None:
    """The repository path of an importable hetc module name, or None (a name inside a module)."""
    for prefix, folder in LINKED.items():
        if module == prefix or module.startswith(prefix + "."):
            module = folder + module[len(prefix):]
            break
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or node.module is None:
        raise AssertionError(f"relative import at line {node.lineno}: hetc imports by absolute name")
    return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]


def import_edges(files: list[Path]) -> set[tuple[str, str]]:
    """(importing path, imported path) for every import of a hetc module, lazy ones included."""
    edges = set()
    for path in files:
        source = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), source)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node):
                if name.split(".")[0] in PACKAGES and (target := _module_path(name)) and target != source:
                    edges.add((source, target))
    return edges


def layer_of(path: str, layers: list[Layer]) -> Layer:
    """The layer whose path is the longest that names `path` (a module, or a folder above it)."""
    owners = [(len(p), layer) for layer in layers for p in layer.paths
              if path == p or (p.endswith("/") and path.startswith(p))]
    if not owners:
        raise AssertionError(f"{path} is in no layer of docs/architecture.md")
    return max(owners, key=lambda owner: owner[0])[1]


def edges_against_order(edges: set[tuple[str, str]], layers: list[Layer]) -> list[str]:
    """Each import of a lower layer's module by a higher one, as one line."""
    out = []
    for source, target in sorted(edges):
        a, b = layer_of(source, layers), layer_of(target, layers)
        if b.rank > a.rank:
            out.append(f"{source} ({a.name}) imports {target} ({b.name}), a layer below it")
    return out


def layer_cycles(edges: set[tuple[str, str]], layers: list[Layer]) -> list[list[str]]:
    graph = nx.DiGraph()
    for source, target in edges:
        a, b = layer_of(source, layers).name, layer_of(target, layers).name
        if a != b:
            graph.add_edge(a, b)
    return [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]


@pytest.fixture(scope="module")
def edges() -> set[tuple[str, str]]:
    return import_edges(source_files())


def test_no_import_cycle_between_layers(edges):
    # the page's exceptions stay out: a cycle is never allowed
    cycles = layer_cycles(edges - page_exceptions(), page_layers())
    assert not cycles, f"import cycles between layers: {cycles}"


def folder_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The groups of folders that import each other round a cycle, each folder read as the package it is
    (`hetc/ir/` apart from `hetc/`, the symlinked packages as their real folders); exceptions included."""
    graph = nx.DiGraph()
    for source, target in edges:
        a, b = source.rsplit("/", 1)[0], target.rsplit("/", 1)[0]
        if a != b:
            graph.add_edge(a, b)
    return [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]


def test_no_import_cycle_between_folders(edges):
    """Issue 30: the folders are the layers, so reading them as packages shows the arrows one way."""
    assert folder_cycles(edges) == []


def test_the_folder_check_finds_a_cycle():
    assert folder_cycles({("hetc/ir/spec.py", "runtime/worker.py"), ("runtime/worker.py", "hetc/ir/plan.py")}) == \
        [["hetc/ir", "runtime"]]


def test_imports_follow_the_layers(edges):
    wrong = edges_against_order(edges - page_exceptions(), page_layers())
    assert not wrong, "imports against docs/architecture.md's order:\n" + "\n".join(wrong)


def test_every_exception_is_still_needed(edges):
    layers = page_layers()
    for source, target in page_exceptions():
        assert (source, target) in edges, f"{source} no longer imports {target}: drop the exception"
        assert edges_against_order({(source, target)}, layers), f"{source} -> {target} is no exception"


def test_every_module_is_in_a_layer():
    layers = page_layers()
    for path in source_files():
        layer_of(path.relative_to(ROOT).as_posix(), layers)


def test_every_package_is_named():
    named = {p for layer in page_layers() for p in layer.paths}
    packages = {path.parent.relative_to(ROOT).as_posix() + "/" for path in source_files()
                if path.name == "__init__.py"}
    assert packages <= named, f"packages missing from the layer table: {sorted(packages - named)}"


def test_every_path_named_exists():
    named = re.findall(r"(?<![\w/.])((?:grammar|hetc|passes|runtime|tests|docs|specs|benchmarks)/[\w./-]*)",
                       PAGE.read_text())
    assert named
    missing = sorted({p for p in named if not (ROOT / p.rstrip(".")).exists()})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_checker_reports_an_upward_import_and_a_cycle():
    layers = page_layers()
    upward = {("hetc/ir/spec.py", "runtime/worker.py")}
    assert edges_against_order(upward, layers) == [
        "hetc/ir/spec.py (ir) imports runtime/worker.py (runtime), a layer below it"]
    assert layer_cycles(upward | {("runtime/worker.py", "hetc/ir/spec.py")}, layers) == [["ir", "runtime"]]


@pytest.mark.parametrize("name", ["grammar", "passes", "runtime"])
def test_the_top_level_folders_are_hetc_packages_by_relative_links(name):
    link = ROOT / "hetc" / name          # Note [layout] in pyproject.toml
    assert link.is_symlink() and Path(link.readlink()) == Path("..") / name


def _called(path: Path) -> set[str]:
    """The names of the functions a module calls by name (`lower(...)`, `x.verify(...)`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_one_build_sequences_lower_verify_and_simulate():
    """Issue 30: cost → lower → verify → simulate was written out by hand in five places; passes/build.py is the
    one that runs it, and every other module asks it."""
    sequencing = [path.relative_to(ROOT).as_posix() for path in source_files()
                  if "verify" in (called := _called(path)) and {"lower", "simulate"} & called]
    assert sequencing == ["passes/build.py"]


_BLOCKS = {"model", "train", "parallel", "cluster"}


def _loose_plan_uses(path: Path) -> list[str]:
    """Functions of `path` that take a spec and a pipeline apart, and asserts that a spec block is present:
    what a Plan (hetc/ir/plan.py) carries checked and typed."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
            if {"spec", "pipeline"} <= params:
                found.append(f"{path.name}:{node.lineno}: {node.name}(spec, pipeline)")
        elif isinstance(node, ast.Assert):
            for test in ast.walk(node.test):
                if isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and \
                        test.left.attr in _BLOCKS and any(isinstance(op, ast.IsNot) for op in test.ops):
                    found.append(f"{path.name}:{node.lineno}: assert ...{test.left.attr} is not None")
    return found


def test_no_function_takes_a_spec_and_a_pipeline_and_no_assert_checks_a_block():
    """Issue 30: every back-end and runtime entry takes the checked Plan, not a loose (spec, pipeline) pair
    re-checking `spec.model is not None`."""
    assert [hit for path in source_files() for hit in _loose_plan_uses(path)] == []


def test_the_loose_plan_check_finds_both(tmp_path):
    path = tmp_path / "loose.py"
    path.write_text("def cost(spec, pipeline):\n    assert spec.model is not None\n")
    assert _loose_plan_uses(path) == ["loose.py:1: cost(spec, pipeline)",
                                      "loose.py:2: assert ...model is not None"]
