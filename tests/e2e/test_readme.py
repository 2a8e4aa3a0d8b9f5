"""The READMEs' checkable claims: the recipes, commands, options, make targets, paths and links they name exist.

A claim is checked where it is written as code (a code span or a fenced block), so prose may say "make" or
"moeprep" freely. Checked in README.md, prep/README.md and loader/README.md:

- every ``moeprep <command>`` and ``moeload <command>`` is a command of that click group;
- every ``--flag`` written after such a command, up to the end of its code span or shell command (a new
  line without a trailing backslash, ``;``, ``&&``, `` | `` or a ``#`` comment), is an option of it;
- every ``make <target>`` is a target of the Makefile;
- every recipe named (``recipes/<name>.yaml``, ``MODEL=<name>``) is a file, every ``recipes/<name>/`` a folder;
- every repository path in code (``prep/...``, ``loader/...``, ``tests/...``, ending in a file
  name or ``/``) exists, and every relative markdown link points inside the repository at something there.

Placeholders are written so that they cannot match: ``recipes/<name>.yaml``, ``MODEL=NAME``. No model loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loader.cli import main as moeload_main
from prep.cli import main as moeprep_main

ROOT = Path(__file__).resolve().parents[2]
READMES = ("README.md", "prep/README.md", "loader/README.md")
GROUPS = {"moeprep": moeprep_main, "moeload": moeload_main}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
SHELL_BREAK = re.compile(r"\s(?:;|&&|\|\||\|)\s|;\s*$")
COMMAND = re.compile(r"(?<![\w.-])(moeprep|moeload)[ \t]+([a-z][a-z0-9-]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
MAKE = re.compile(r"(?<![\w.-])make[ \t]+([a-z][a-z0-9-]*)")
RECIPE_FILE = re.compile(r"(?<![\w.-])recipes/([a-z0-9][a-z0-9._-]*)\.yaml\b")
RECIPE_DIR = re.compile(r"(?<![\w.-])recipes/([a-z0-9][a-z0-9._-]*)/")
MODEL_VAR = re.compile(r"(?<![\w-])MODEL=([a-z0-9][a-z0-9._-]*)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:prep|loader|tests)/[\w./-]*?(?:\.(?:py|md|yaml|json|jsonl|safetensors)\b|/))")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_segments(text: str) -> list[str]:
    """The text's code, one string per shell command: each fenced block's lines (backslash continuations
    joined, ``#`` comments dropped), then each inline code span (its line breaks made spaces)."""
    segments = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)
            segments += SHELL_BREAK.split(line)
    for span in SPAN.findall(FENCE.sub("", text)):
        segments += SHELL_BREAK.split(span.replace("\n", " "))
    return [s for s in segments if s.strip()]


def commands(text: str) -> list[tuple[str, str, list[str]]]:
    """Every (program, command, flags written after it) in the text's code."""
    found = []
    for segment in code_segments(text):
        matches = list(COMMAND.finditer(segment))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(segment)
            found.append((m.group(1), m.group(2), FLAG.findall(segment, m.end(), end)))
    return found


def make_targets(makefile: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*)[ \t]*:(?!=)", makefile, re.M))


def problems(text: str, root: Path = ROOT, groups=None) -> list[str]:
    """What the text claims in code that the repository contradicts; [] when every claim holds."""
    groups = groups or GROUPS
    out = []
    for program, name, flags in commands(text):
        command = groups[program].commands.get(name)
        if command is None:
            out.append(f"`{program} {name}`: no such command (has {', '.join(sorted(groups[program].commands))})")
            continue
        options = {o for p in command.params for o in p.opts + p.secondary_opts}
        out += [f"`{program} {name} {flag}`: no such option" for flag in flags if flag not in options]
    code = "\n".join(code_segments(text))
    targets = make_targets((root / "Makefile").read_text())
    out += [f"`make {t}`: no such Makefile target" for t in MAKE.findall(code) if t not in targets]
    out += [f"recipes/{r}.yaml does not exist" for r in RECIPE_FILE.findall(text) + MODEL_VAR.findall(text)
            if not (root / "recipes" / f"{r}.yaml").is_file()]
    out += [f"recipes/{r}/ does not exist" for r in RECIPE_DIR.findall(text) if not (root / "recipes" / r).is_dir()]
    out += [f"{p} does not exist" for p in REPO_PATH.findall(code) if not (root / p).exists()]
    return out


def link_problems(readme: Path, root: Path = ROOT) -> list[str]:
    """Relative markdown links that leave the repository or point at nothing."""
    out = []
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (readme.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(root):
            out.append(f"{target}: outside the repository")
        elif not path.exists():
            out.append(f"{target}: does not exist")
    return out


@pytest.mark.parametrize("name", READMES)
def test_readme_claims_hold(name):
    text = (ROOT / name).read_text()
    assert problems(text) == [], f"{name} claims what the repository does not hold"
    assert link_problems(ROOT / name) == []


def test_readme_opens_with_the_quickstart_and_links_the_references():
    """The top README shows the quickstart's commands, links the two reference READMEs and nothing outside the repo."""
    text = (ROOT / "README.md").read_text()
    named = {(p, c) for p, c, _ in commands(text)}
    assert {("moeprep", "prepare"), ("moeload", "generate"), ("moeprep", "bench")} <= named
    assert {"make test", "make prepare"} <= set(re.findall(r"make [a-z-]+", "\n".join(code_segments(text))))
    assert "(prep/README.md)" in text and "(loader/README.md)" in text
    assert "../shared/DESIGN.md" not in text


def test_the_checker_finds_wrong_claims(tmp_path):
    """The extractor is not vacuous: a sample with one wrong claim of each kind yields exactly those."""
    sample = """
Run `moeprep bench --quick --traces DIR --no-such-flag` and then `moeprep frobnicate`.
```
make prepare MODEL=reference            # fine
make no-such-target                     # wrong
moeload generate ARTIFACT \\
    --prompt hi --bogus-option          # wrong, on a continuation line
.venv/bin/moeload info ARTIFACT --json; moeload verify ARTIFACT --nope
```
Recipes: `recipes/reference.yaml`, `recipes/not-a-recipe.yaml`, `make prepare MODEL=nor-this`, `prep/no_such.py`.
A placeholder is fine: `recipes/<name>.yaml`, `MODEL=NAME`, and so is prose: make sure moeprep works.
    """
    assert sorted(problems(sample)) == sorted([
        "`moeprep bench --no-such-flag`: no such option",
        f"`moeprep frobnicate`: no such command (has {', '.join(sorted(moeprep_main.commands))})",
        "`moeload generate --bogus-option`: no such option",
        "`moeload verify --nope`: no such option",
        "`make no-such-target`: no such Makefile target",
        "recipes/not-a-recipe.yaml does not exist",
        "recipes/nor-this.yaml does not exist",
        "prep/no_such.py does not exist",
    ])
    # and the right claims of the sample were seen, with their flags
    assert ("moeload", "generate", ["--prompt", "--bogus-option"]) in commands(sample)
    assert ("moeload", "info", ["--json"]) in commands(sample)

    readme = tmp_path / "README.md"
    readme.write_text("[design](../shared/DESIGN.md), [gone](nowhere.md), [ok](README.md), [web](https://x.org)")
    assert link_problems(readme, tmp_path) == ["../shared/DESIGN.md: outside the repository", "nowhere.md: does not exist"]
