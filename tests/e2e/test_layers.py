"""The packages' layering, read from every module's imports (module level and inside functions):

- ``loader`` never imports ``prep`` (a device team ships the runtime alone);
- no import cycle in ``prep`` (nor in ``loader``);
- ``prep.report`` imports no stage and no study (it sits below both);
- ``prep.methods`` imports no stage, recipe, report or study (algorithms know none of them);
- studies are imported only by ``prep/cli.py`` (a study may use its own package and ``prep.studies.common``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of prep and loader."""
    out = {}
    for path in sorted([*root.glob("prep/**/*.py"), *root.glob("loader/**/*.py")]):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (a name imported from a package counts as
    that package's submodule when there is one)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


EDGES = graph()


def test_the_loader_never_imports_prep():
    assert {m: sorted(t for t in ts if _in(t, "prep")) for m, ts in EDGES.items()
            if _in(m, "loader") and any(_in(t, "prep") for t in ts)} == {}


def test_no_import_cycle():
    assert cycles(EDGES) == []


def test_the_report_imports_no_stage_and_no_study():
    bad = {m: sorted(t for t in ts if _in(t, "prep.stages") or _in(t, "prep.studies"))
           for m, ts in EDGES.items() if _in(m, "prep.report")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_methods_import_no_stage_recipe_report_or_study():
    banned = ("prep.stages", "prep.recipe", "prep.report", "prep.studies", "prep.pipeline")
    bad = {m: sorted(t for t in ts if any(_in(t, b) for b in banned)) for m, ts in EDGES.items()
           if _in(m, "prep.methods")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def _study_of(module: str) -> str | None:
    """The study a module belongs to (``prep.studies.bench`` for ``prep.studies.bench.run``), None outside."""
    parts = module.split(".")
    return ".".join(parts[:3]) if _in(module, "prep.studies") and len(parts) >= 3 else None


def test_studies_are_imported_only_by_the_cli():
    allowed = {"prep.studies.common", "prep.studies"}
    bad = []
    for module, targets in EDGES.items():
        for target in targets:
            study = _study_of(target)
            if study is None or target in allowed or module == "prep.cli":
                continue
            if _study_of(module) == study:  # a study's own package
                continue
            bad.append((module, target))
    assert bad == []


def test_the_checks_see_what_they_check(tmp_path):
    """The parser and the cycle finder on a made-up tree: a function-level import, a relative one, a cycle."""
    (tmp_path / "prep" / "methods").mkdir(parents=True)
    (tmp_path / "loader").mkdir()
    (tmp_path / "prep" / "__init__.py").write_text("")
    (tmp_path / "prep" / "methods" / "__init__.py").write_text("")
    (tmp_path / "loader" / "__init__.py").write_text("")
    (tmp_path / "prep" / "recipe.py").write_text("from prep.methods import fit\n")
    (tmp_path / "prep" / "methods" / "fit.py").write_text("def f():\n    from prep.recipe import Recipe\n")
    (tmp_path / "loader" / "run.py").write_text("from . import x\nimport prep.recipe\n")
    edges = graph(tmp_path)
    assert edges["prep.methods.fit"] == {"prep.recipe"}
    assert edges["prep.recipe"] == {"prep.methods.fit"}
    assert edges["loader.run"] == {"prep.recipe", "loader"}
    assert cycles(edges) == [["prep.methods.fit", "prep.recipe"]]


def floors(edges: dict[str, set[str]], package: str) -> dict[str, int]:
    """Each module of ``package`` -> its floor in the import layering inside the package: 1 for a module that imports
    none of the package's others, else one above the highest it imports (the graph has no cycle)."""
    inside = {m: {t for t in ts if _in(t, package) and t not in (m, package)} for m, ts in edges.items()
              if _in(m, package) and m != package}
    out: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in out:
            out[module] = 1 + max((floor(t) for t in inside.get(module, ())), default=0)
        return out[module]

    for module in inside:
        floor(module)
    return out


def test_the_loader_is_at_most_nine_floors_tall():
    """A device team reads the runtime bottom up: its longest chain of imports stays short."""
    tall = floors(EDGES, "loader")
    assert max(tall.values()) <= 9, sorted(tall.items(), key=lambda kv: -kv[1])[:5]


def test_floors_count_the_longest_chain():
    edges = {"loader.a": set(), "loader.b": {"loader.a"}, "loader.c": {"loader.a", "loader.b"}, "loader.d": {"loader.a"}}
    assert floors(edges, "loader") == {"loader.a": 1, "loader.b": 2, "loader.c": 3, "loader.d": 2}
