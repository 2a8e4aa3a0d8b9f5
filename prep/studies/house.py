"""The house's measures, read from the source: code lines per loader file (blank lines, comments and docstrings
left out), functions over a length, constructors over a parameter count. ``make loc`` prints them;
``tests/e2e/test_house_measures.py`` holds the loader and the bench to the limits.

    python -m prep.studies.house [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_CONSTRUCTOR_PARAMETERS = 6  # self excluded


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not a comment alone, not part of a module, class or function docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    line: int
    lines: int  # from its def to its last line
    parameters: int  # self and cls left out

    @property
    def constructor(self) -> bool:
        return self.name == "__init__"


def functions(root: Path, pattern: str) -> list[Function]:
    """Every function and method in the files ``pattern`` matches under ``root``."""
    out = []
    for path in sorted(root.glob(pattern)):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            count = len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0) + bool(a.vararg) + bool(a.kwarg)
            out.append(Function(str(path.relative_to(root)), node.name, node.lineno,
                                node.end_lineno - node.lineno + 1, count))
    return out


def too_long(root: Path = ROOT) -> list[Function]:
    """Functions over ``MAX_FUNCTION_LINES`` in the loader and the bench."""
    found = functions(root, "loader/**/*.py") + functions(root, "prep/studies/bench/*.py")
    return [f for f in found if f.lines > MAX_FUNCTION_LINES]


def wide_constructors(root: Path = ROOT) -> list[Function]:
    """Loader constructors over ``MAX_CONSTRUCTOR_PARAMETERS``."""
    return [f for f in functions(root, "loader/**/*.py") if f.constructor and f.parameters > MAX_CONSTRUCTOR_PARAMETERS]


def loader_lines(root: Path = ROOT) -> dict[str, int]:
    return {p.name: code_lines(p.read_text()) for p in sorted((root / "loader").glob("*.py"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    root = parser.parse_args(argv).root
    lines = loader_lines(root)
    print("loader code lines (blank lines, comments and docstrings left out):")
    for name, count in sorted(lines.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {name}")
    print(f"  {sum(lines.values()):5d}  in all")
    everything = functions(root, "loader/**/*.py")
    print(f"loader: {len(everything)} functions, the longest {max(f.lines for f in everything)} lines; "
          f"{sum(f.parameters > MAX_CONSTRUCTOR_PARAMETERS for f in everything)} take more than "
          f"{MAX_CONSTRUCTOR_PARAMETERS} parameters")
    for what, found in (("over 80 lines (loader, bench)", too_long(root)),
                        ("constructors over 6 parameters (loader)", wide_constructors(root))):
        print(f"{what}: {len(found)}")
        for f in found:
            print(f"  {f.path}:{f.line} {f.name} ({f.lines} lines, {f.parameters} parameters)")


if __name__ == "__main__":
    main()
