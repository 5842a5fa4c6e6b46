"""The source tree's shape: package imports form no cycle, the bottom layers make no network calls, no module
grows past the size the codebase keeps (issue 24)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ggufswarm"
# Packages that describe and compute (files, models, shards, the wire format): never a network call.
NO_NETWORK = ("artifact", "model", "runtime", "protocol")
# (a module importing any of these, or a name from one, could open a connection; HTTP glue lives in net/)
NETWORK_CLIENTS = ("aiohttp", "socket", "urllib.request", "http.client", "websocket", "websockets", "requests")
MAX_MODULE_LINES = 520
# A module docstring says what the module is for and points to its docs section; the rest lives in docs/ (issue 40)
MAX_MODULE_DOC_LINES = 12


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, path.relative_to(SRC).with_suffix("").parts


def _imports(path: Path, parts: tuple[str, ...]):
    """Absolute dotted names (within ggufswarm: ``ggufswarm.x.y``) that the module at ``path`` imports, anywhere
    in it (a function-local import is a dependency too)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        yield from _imports_of(node, parts)


def _imports_of(node: ast.AST, parts: tuple[str, ...]):
    """The absolute dotted names one import statement ``node`` of the module ``parts`` names (none for another node)."""
    package = ("ggufswarm", *parts[:-1])
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = list(package[: len(package) - (node.level - 1)]) if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        yield module
        yield from (f"{module}.{a.name}" for a in node.names)  # `from . import x` names a module


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path, parts in _modules():
        own = parts[0] if len(parts) > 1 else "(top)"
        for name in _imports(path, parts):
            bits = name.split(".")
            if bits[0] == "ggufswarm" and len(bits) > 1 and (SRC / bits[1]).is_dir() and bits[1] != own:
                graph.setdefault(own, set()).add(bits[1])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (package -> packages it imports) as ``[a, b, ..., a]``, or None (depth-first)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(pkg: str, trail: list[str]) -> list[str] | None:
        state[pkg] = 1
        for dep in sorted(graph.get(pkg, ())):
            if state.get(dep) == 1:
                path = trail + [pkg]
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep, trail + [pkg])):
                return found
        state[pkg] = 2
        return None

    for pkg in sorted(graph):
        if pkg not in state and (found := visit(pkg, [])):
            return found
    return None


def test_packages_import_each_other_without_a_cycle():
    graph = _package_graph()
    assert {"gateway", "node", "client", "runtime"} <= set(graph)  # the graph is read at all
    assert find_cycle(graph) is None, "package import cycle: " + " -> ".join(find_cycle(graph))


def _design_order() -> list[str]:
    """The packages in the order docs/design.md's "Parts" table lists them, bottom up."""
    text = (SRC.parents[1] / "docs" / "design.md").read_text()
    table = text[text.index("## Parts") :].split("\n## ")[0]
    return [m.group(1) for m in re.finditer(r"^\| ([a-z]+) \|", table, re.M) if m.group(1) != "package"]


def test_each_package_imports_only_those_below_it_in_the_design():
    """docs/design.md lists the packages bottom up: each imports only packages listed before it (the layering the
    design describes is the code's), and every package is listed."""
    order, graph = _design_order(), _package_graph()
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert set(order) == packages, (sorted(packages - set(order)), sorted(set(order) - packages))
    upward = [
        f"{pkg} imports {dep}"
        for pkg, deps in graph.items()
        if pkg in order
        for dep in deps
        if order.index(dep) > order.index(pkg)
    ]
    assert not upward, f"imports against docs/design.md's order {order}: {upward}"


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (for annotations only: never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _module_graph() -> dict[str, set[str]]:
    """module -> the modules of its own package it imports when run (``client.ring`` -> ``client.session``)."""
    names = {".".join(p for p in parts if p != "__init__"): (path, parts) for path, parts in _modules()}
    graph: dict[str, set[str]] = {}
    for name, (path, parts) in names.items():
        if parts[-1] == "__init__":
            continue
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        own = name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for dep in _imports_of(node, parts):
                dep = dep.removeprefix("ggufswarm.")
                while dep and dep not in names:
                    dep = dep.rpartition(".")[0]
                if dep and dep != name and dep.rpartition(".")[0] == own and names[dep][1][-1] != "__init__":
                    graph.setdefault(name, set()).add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_modules_inside_a_package_import_each_other_without_a_cycle():
    """A module imports the modules of its own package without a circle (a function-level import counts: it runs;
    one under ``if TYPE_CHECKING:`` does not)."""
    graph = _module_graph()
    assert {"client.session", "gateway.app"} <= set(graph)  # read at all
    assert _cycles(graph) == []


def test_the_module_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_the_bottom_layers_make_no_network_calls():
    offenders = []
    for path, parts in _modules():
        if parts[0] in NO_NETWORK:
            for name in _imports(path, parts):
                if any(name == c or name.startswith(c + ".") for c in NETWORK_CLIENTS):
                    offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, offenders


def test_the_network_check_sees_plain_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("import aiohttp\nimport socket as s\nfrom aiohttp import web\nfrom urllib.request import urlopen\n")
    names = set(_imports(mod, ("runtime", "m")))
    caught = {n for n in names if any(n == c or n.startswith(c + ".") for c in NETWORK_CLIENTS)}
    assert {"aiohttp", "socket", "aiohttp.web", "urllib.request.urlopen"} <= caught


def test_no_module_is_over_the_size_limit():
    long = {
        str(path.relative_to(SRC)): n
        for path, _ in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_every_module_says_what_it_is_for():
    silent = [
        str(path.relative_to(SRC))
        for path, _ in _modules()
        if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not silent, f"modules without a docstring: {silent}"


def test_module_docstrings_are_short():
    long = {
        str(path.relative_to(SRC)): n
        for path, _ in _modules()
        if (doc := ast.get_docstring(ast.parse(path.read_text())))
        and (n := len(doc.splitlines())) > MAX_MODULE_DOC_LINES
    }
    assert not long, f"module docstrings over {MAX_MODULE_DOC_LINES} lines (move the rest to docs/): {long}"


def test_every_noqa_gives_its_reason():
    """A ``# noqa: CODE`` silences the linter (ruff, pyproject.toml) for a line: it says why, after the codes."""
    root = SRC.parents[1]
    bare = []
    for path in sorted(
        [*root.glob("src/**/*.py"), *root.glob("tests/*.py"), *root.glob("bench/*.py"), *root.glob("scripts/*.py")]
    ):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if (m := re.search(r"# noqa\b(:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(.*)$", line)) and not re.search(
                r"[a-z]", m.group(2)
            ):
                bare.append(f"{path.relative_to(root)}:{n}")
    assert not bare, f"# noqa without a reason: {bare}"


def test_every_relative_import_names_a_module_or_package_that_exists():
    """Function-local imports run only when their code does: a relative import that names no module of the tree
    (``from .client import x`` in a subpackage that has no ``client``) is found here, not by a user."""
    missing = []
    for path, parts in _modules():
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(package[: len(package) - (node.level - 1)])
                target = SRC.joinpath(*base, *(node.module.split(".") if node.module else []))
                if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno} from {'.' * node.level}{node.module or ''}")
    assert not missing, f"relative imports of nothing: {missing}"
