"""The house's limits, measured from the source (``prep/studies/house.py``): no function over 80 lines in the loader
and the bench, no loader constructor over 6 parameters."""

from __future__ import annotations

from prep.studies.house import code_lines, functions, too_long, wide_constructors


def test_no_function_in_the_loader_or_the_bench_is_over_80_lines():
    assert [(f.path, f.name, f.lines) for f in too_long()] == []


def test_no_loader_constructor_takes_more_than_six_parameters():
    assert [(f.path, f.parameters) for f in wide_constructors()] == []


def test_the_measures_on_a_made_up_file(tmp_path):
    source = '''"""A module docstring
on two lines."""

# a comment
X = 1


class A:
    """A class docstring."""

    def __init__(self, a, b, *rest, c=1, **more):
        """Its docstring."""
        self.a = a  # a trailing comment keeps the line


def long():
''' + "    y = 0\n" * 81
    assert code_lines(source) == 5 + 81  # X, class, def __init__, self.a, def long; and long's body
    (tmp_path / "loader").mkdir()
    (tmp_path / "loader" / "m.py").write_text(source)
    found = {f.name: f for f in functions(tmp_path, "loader/*.py")}
    assert found["__init__"].parameters == 5 and found["__init__"].constructor  # a, b, *rest, c, **more
    assert found["long"].lines == 82
    assert [f.name for f in too_long(tmp_path)] == ["long"]
    assert [f.name for f in wide_constructors(tmp_path)] == []
