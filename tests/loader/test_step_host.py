"""The layer steps are peers on one typed host: every member of the engine the whole-expert step and the neuron step
use is declared by ``loader.layer.StepHost``, none is private, and the engine has each of them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from loader.engine import ExpertEngine
from loader.layer import StepHost

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"loader/step.py": "WholeStep", "loader/neuron.py": "NeuronStep"}


def declared() -> set[str]:
    """The members ``StepHost`` declares: its annotated attributes and its methods."""
    methods = {name for name, value in vars(StepHost).items() if inspect.isfunction(value) and not name.startswith("__")}
    return set(StepHost.__annotations__) | methods


def host_accesses(source: str, cls: str) -> set[str]:
    """Attribute names read through the host inside class ``cls``: ``self.host.X``, and ``X`` of a local
    bound to ``self.host`` (``host = self.host`` or ``host, ... = self.host, ...``)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)

    def is_self_host(expr) -> bool:
        return (isinstance(expr, ast.Attribute) and expr.attr == "host" and isinstance(expr.value, ast.Name)
                and expr.value.id == "self")

    found = set()
    for fn in [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef)]:
        aliases = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for target in n.targets:
                    pairs = (zip(target.elts, n.value.elts, strict=False)
                             if isinstance(target, ast.Tuple) and isinstance(n.value, ast.Tuple) else [(target, n.value)])
                    aliases |= {t.id for t, v in pairs if isinstance(t, ast.Name) and is_self_host(v)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute):
                if is_self_host(n.value) or (isinstance(n.value, ast.Name) and n.value.id in aliases):
                    found.add(n.attr)
    return found


def test_the_steps_use_only_what_the_host_declares():
    members = declared()
    for path, cls in STEPS.items():
        used = host_accesses((ROOT / path).read_text(), cls)
        assert used, f"{cls} reads nothing through its host: the check sees nothing"
        assert used <= members, f"{cls} uses host members StepHost does not declare: {sorted(used - members)}"
        assert not [m for m in used if m.startswith("_")], f"{cls} reaches private host members"


def test_no_step_reaches_the_engine_by_another_name():
    """A step holds its host as ``self.host`` only: no ``engine`` attribute or local to bypass the check."""
    for path, cls in STEPS.items():
        tree = ast.parse((ROOT / path).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        assert "engine" not in names, f"{cls} names an engine beside its host"


def test_the_engine_provides_every_declared_member():
    source = inspect.getsource(ExpertEngine)
    methods = {name for name, _ in inspect.getmembers(ExpertEngine, inspect.isfunction)}
    assigned = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                and isinstance(n.ctx, ast.Store):
            assigned.add(n.attr)
    missing = declared() - methods - assigned
    assert missing == set(), f"StepHost declares members ExpertEngine lacks: {sorted(missing)}"


def test_the_check_sees_an_undeclared_member():
    """The parser on a made-up step: a direct access, one through a local alias and one through a tuple alias."""
    source = '''
class Fake:
    def run(self):
        self.host.cache.find(1)
        host = self.host
        host._secret()
        a, host2 = 1, self.host
        host2.undeclared
'''
    assert host_accesses(source, "Fake") == {"cache", "_secret", "undeclared"}
