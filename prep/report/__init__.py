"""The artifact's report: report.json (an entry per stage or study), report.md rendered from it, plots under
``reports/``. One owner, below the stages and the studies: they hand it entries, it merges, renders and re-lists
the files in the manifest. It imports no stage and no study.

report.md is a header, then the sections of a ``ReportLayout`` (``prep/report/sections.py``): each stage result
declares the sections it renders, the stage table gathers them (``prep.stages.table.REPORT``), and whoever writes
hands that layout here. ``report_files`` renders both files; the package stage writes them into a new artifact,
``merge_section`` into an existing one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import loader.io  # called through the module: a test can interpose on each write
from loader.errors import PREPARE_AGAIN
from loader.format import (
    REPORT,
    REPORTS_DIR,
    ArtifactError,
    is_informational,
    read_json,
    read_manifest,
    report_problem,
    sha256_file,
    write_manifest,
)
from prep.errors import MoeprepError
from prep.report.sections import ReportLayout, ReportSection, study_section

__all__ = ["BITWIDTH_PLOT", "MARKDOWN", "PENDING", "ROUTING_PLOT", "ReportLayout", "ReportSection", "current_report",
           "merge_section", "report_files", "study_section"]

BITWIDTH_PLOT = f"{REPORTS_DIR}report.png"
ROUTING_PLOT = f"{REPORTS_DIR}report-routing.png"
MARKDOWN = "report.md"


def report_files(name: str, report: dict, layout: ReportLayout | None) -> dict[str, bytes]:
    """report.json and report.md of ``report`` (the artifact ``name``'s) as written, report.json only without a
    ``layout``: the one place both are rendered, for a new artifact and for an update alike."""
    files = {REPORT: (json.dumps(report, indent=2) + "\n").encode()}
    if layout is not None:
        files[MARKDOWN] = layout.markdown(name, report).encode()
    return files


def current_report(manifest) -> dict:
    """The artifact's report.json, refused unless it is the one the manifest lists (or the one an interrupted
    update recorded in ``PENDING``): a report never re-blessed after an edit. {} when the artifact has none.
    ``moeprep eval`` calls it before evaluating, so an altered report is found at once, not after the evaluation."""
    path, pending = manifest.path(REPORT), manifest.root / PENDING
    listed = manifest.files.get(REPORT)
    if not path.exists():
        if listed is not None:
            raise ArtifactError(f"{path} is missing though the manifest lists it: the artifact is damaged. Run "
                                "`moeload verify`, then re-run `moeprep prepare`", file=REPORT)
        return {}
    digest = sha256_file(path)
    ours = listed is not None and digest == listed["sha256"]
    if not ours and pending.is_file():
        try:
            ours = read_json(pending, PENDING).get("sha256") == digest
        except (ArtifactError, AttributeError):
            ours = False
    if not ours:
        raise ArtifactError(f"{path} is not the report.json the manifest lists (its sha256 differs): the "
                            "artifact was altered, and eval will not bless a file it did not write. Run "
                            "`moeload verify`, then re-run `moeprep prepare`", file=REPORT)
    current = read_json(path, REPORT)
    if problem := report_problem(current):  # the check `moeload info` and `plan` run (loader.artifact.read_report)
        raise ArtifactError(f"{path}: {problem}; {PREPARE_AGAIN}", file=REPORT)
    return current


PENDING = ".eval-pending.json"  # the hash of a report.json being blessed, while eval updates the artifact


def merge_section(artifact: str | Path, sections: dict, layout: ReportLayout | None,
                  files: dict[str, bytes] | None = None, package_key: str | None = None) -> dict:
    """Merge ``sections`` (report.json entries) into the artifact's report, render report.md again with ``layout``,
    write the informational ``files`` (plots, named under ``reports/``) and list the new hashes in the manifest;
    returns the new report.json. ``layout`` None leaves report.md as it is: only for a caller that cannot know the
    stage table (``prep.evals.compare`` scoring a study's row); every other writer passes ``prep.stages.table.REPORT``.

    Never re-blesses a report.json it did not write: the current one must hash as the manifest says (or
    as ``PENDING`` says, when an earlier eval was killed between its two renames), else the artifact
    was altered and this refuses. The update is two atomic renames, report.json then manifest.json,
    after the new hash is recorded in ``PENDING`` (report.md and the plots are written first, each atomically).
    Loading never depends on report.json's hash, so the artifact loads at every instant; ``verify`` passes before
    and after. ``package_key``: the artifact evaluated; if it was re-prepared meanwhile, refuse.
    """
    manifest = read_manifest(artifact)
    root = manifest.root
    if package_key is not None and manifest.raw["package_key"] != package_key:
        raise MoeprepError(f"{root} was prepared again while eval ran; its report.json is left as it is. "
                           "Run `moeprep eval` again on the new artifact")
    path, pending = manifest.path(REPORT), root / PENDING
    current = current_report(manifest) | sections
    rendered = report_files(manifest.raw.get("recipe", {}).get("name", "artifact"), current, layout)
    data = rendered.pop(REPORT)
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    extra = {}
    for name, content in (rendered | (files or {})).items():
        if not is_informational(name):
            raise MoeprepError(f"{name!r} is not an informational file of the artifact (report.json, report.md, "
                               f"or a file under {REPORTS_DIR})")
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        loader.io.write_bytes_atomic(root / name, content)
        extra[name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    loader.io.write_json_atomic(pending, {"sha256": entry["sha256"]})
    loader.io.write_bytes_atomic(path, data)
    write_manifest(root, manifest.raw | {"files": manifest.files | extra | {REPORT: entry}})
    pending.unlink(missing_ok=True)
    return current
