"""Adding a stage touches three files: its module, one row of the stage table, and its test.

The proof runs on a copy of the packages: a toy stage module is written (a recipe section that checks its own
keys, a rule across sections, a result whose plan contribution is the plan's default budget), one row is added
to ``prep/stages/table.py``, and a tiny model is prepared in a fresh interpreter. The recipe takes the new
section, its rules refuse bad input, and the artifact's plan carries the contribution; nothing else changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

TOY = '''"""A toy stage: it writes the plan's default budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prep.errors import MoeprepError
from prep.stages import Stage, StageResult


@dataclass(frozen=True)
class ToySection:
    enabled: bool = False
    budget: str = "40%"

    def __post_init__(self) -> None:
        if not self.budget.endswith("%"):
            raise MoeprepError(f"toy.budget must be a percentage, got {self.budget!r}")


@dataclass(frozen=True)
class ToyBudget(StageResult):
    budget: str

    def apply(self, plan, context):
        return dataclasses.replace(plan, default_budget=self.budget)


def check(recipe) -> None:
    if recipe.toy.enabled and recipe.quantize.precision == "passthrough":
        raise MoeprepError("toy needs quantized experts: set quantize.precision")


STAGE = Stage(name="toy", version=1, config=ToySection, result=ToyBudget, run=lambda inputs: ToyBudget(
    inputs.config.budget), enabled=lambda recipe: recipe.toy.enabled, section="toy", check=check)
'''

RUN = '''
import json, sys
from pathlib import Path
from prep.errors import MoeprepError
from prep.pipeline import prepare
from tests.helpers.tiny_models import save_tiny_model, tiny_recipe

root = Path(sys.argv[1])
out = {}
for bad in ({"toy": {"enabled": True, "budget": "lots"}}, {"toy": {"enabled": True}, "precision": "passthrough"}):
    precision = bad.pop("precision", "int4")
    try:
        tiny_recipe(precision, **bad)
        out.setdefault("refused", []).append(None)
    except MoeprepError as e:
        out.setdefault("refused", []).append(str(e))
save_tiny_model("qwen3_moe", root / "model")
prepare(tiny_recipe("int4", toy={"enabled": True, "budget": "35%"}), root=root, output=root / "artifact")
out["plan_budget"] = json.loads((root / "artifact" / "plan.json").read_text())["default_budget"]
print(json.dumps(out))
'''


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.py"))
            if "__pycache__" not in p.parts}


def test_a_new_stage_is_its_module_one_table_row_and_its_test(tmp_path):
    copy = tmp_path / "repo"
    for name in ("prep", "loader"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tests" / "helpers").mkdir(parents=True)
    shutil.copy2(REPO / "tests" / "helpers" / "tiny_models.py", copy / "tests" / "helpers" / "tiny_models.py")
    before = _files(copy)

    (copy / "prep" / "stages" / "toy.py").write_text(TOY)
    table = copy / "prep" / "stages" / "table.py"
    text = table.read_text()
    assert "    package.STAGE,\n" in text and "    tune_policy,\n)" in text
    table.write_text(text.replace("    tune_policy,\n)", "    toy,\n    tune_policy,\n)", 1)
                     .replace("    package.STAGE,\n", "    toy.STAGE,\n    package.STAGE,\n", 1))

    after = _files(copy)
    touched = sorted(k for k in after if before.get(k) != after[k])
    assert touched == ["prep/stages/table.py", "prep/stages/toy.py"]  # and this test: three files

    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", RUN, str(work)], cwd=copy, capture_output=True, text=True,
                          timeout=600, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy),
                                            "MOEPREP_EXPERT_DTYPE": "float32", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "toy.budget must be a percentage" in out["refused"][0]
    assert "toy needs quantized experts" in out["refused"][1]
    assert out["plan_budget"] == "35%"
