"""The artifact's report: report.json (a section per stage or study), report.md rendered from it, plots under
``reports/``. One owner, below the stages and the studies: they hand it a section, it merges, renders and
re-lists the files in the manifest. It imports no stage and no study.

A study's section carries its own markdown (``section["markdown"]``); the stages' sections are rendered here
(``prep/report/sections.py``). ``report.md`` is a header, then the sections in the fixed order ``ORDER``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import loader.io  # called through the module: a test can interpose on each write
from loader.format import (
    REPORT,
    REPORTS_DIR,
    ArtifactError,
    is_informational,
    read_json,
    read_manifest,
    sha256_file,
    write_manifest,
)
from prep.errors import MoeprepError
from prep.report.sections import (
    PLAN_PLOT,
    accuracy_markdown,
    neuron_markdown,
    operating_points_markdown,
    prediction_markdown,
)

BITWIDTH_PLOT = f"{REPORTS_DIR}report.png"
ROUTING_PLOT = f"{REPORTS_DIR}report-routing.png"


def _study(key: str, plot: str | None = None, alt: str = ""):
    """A study's section: the markdown it carries, and its plot."""
    def render(report: dict) -> list[str]:
        section = report.get(key) or {}
        text = section.get("markdown") if isinstance(section, dict) else None
        if not text:
            return []
        return [text.rstrip(), *([f"![{alt}]({plot})"] if plot else []), ""]
    return render


def _neuron(report: dict) -> list[str]:
    return [neuron_markdown(report["neuron"]), ""] if report.get("neuron") else []


def _prediction(report: dict) -> list[str]:
    return [prediction_markdown(report["prediction"]), ""] if report.get("prediction") else []


def _accuracy(report: dict) -> list[str]:
    return [accuracy_markdown(report), ""] if (report.get("eval") or {}).get("suites") else []


def _operating_points(report: dict) -> list[str]:
    if not report.get("operating_points"):
        return []
    return [operating_points_markdown(report), "", f"![operating points]({PLAN_PLOT})", ""]


# report.md's sections, in this order: (report.json key, renderer)
ORDER = (("eval", _accuracy), ("bitwidth_study", _study("bitwidth_study", BITWIDTH_PLOT, "accuracy delta against expert bytes")), ("prediction", _prediction),
         ("prediction_study", _study("prediction_study")), ("operating_points", _operating_points),
         ("routing_study", _study("routing_study", ROUTING_PLOT, "accuracy delta against miss rate")), ("neuron", _neuron))


def report_markdown(name: str, report: dict) -> str:
    """The artifact's report.md, a function of report.json: what the artifact holds, then each section."""
    sizes, bw = report["sizes"], report.get("bitwidth", {})
    mix = ", ".join(f"{p} {n}" for p, n in bw.get("experts", {}).items())
    lines = [f"# {name}: {report.get('architecture', '')}", "",
             f"- Experts: {mix} ({bw.get('method', 'uniform')}); {sizes['expert_bytes'] / 2**20:.2f} MiB, "
             f"{report['compression']['bfloat16']:.2f}x smaller than bfloat16, "
             f"{report['compression']['source']:.2f}x than the source; dense weights "
             f"{sizes['dense_bytes'] / 2**20:.2f} MiB.", ""]
    for _key, render in ORDER:
        lines += render(report)
    return "\n".join(lines)


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
    if not isinstance(current, dict):
        raise ArtifactError(f"{path} must hold a JSON object; re-run `moeprep prepare`", file=REPORT)
    return current


def merge_section(artifact: str | Path, sections: dict, files: dict[str, bytes] | None = None,
                  package_key: str | None = None) -> dict:
    """Merge ``sections`` (report.json keys) into the artifact's report, render report.md again, write ``files``
    (plots, named under ``reports/``) and re-list everything in the manifest; returns the new report.json."""
    manifest = read_manifest(artifact)
    report = read_json(manifest.path(REPORT), REPORT) | sections
    text = report_markdown(manifest.raw.get("recipe", {}).get("name", "artifact"), report)
    update_artifact_report(manifest.root, sections, files={"report.md": text.encode()} | (files or {}),
                           package_key=package_key)
    return report


PENDING = ".eval-pending.json"  # the hash of a report.json being blessed, while eval updates the artifact


def update_artifact_report(artifact: str | Path, sections: dict, files: dict[str, bytes] | None = None,
                           package_key: str | None = None) -> None:
    """Merge ``sections`` into the artifact's report.json, write the informational ``files`` (report.md,
    report.png) beside it, and list the new hashes in the manifest.

    Never re-blesses a report.json it did not write: the current one must hash as the manifest says (or
    as ``PENDING`` says, when an earlier eval was killed between its two renames), else the artifact
    was altered and this refuses. The update is two atomic renames, report.json then manifest.json,
    after the new hash is recorded in ``PENDING``. Loading never depends on report.json's hash, so the
    artifact loads at every instant; ``verify`` passes before and after (and between the renames names
    report.json only). ``package_key``: the artifact evaluated; if it was re-prepared meanwhile, refuse.
    """
    manifest = read_manifest(artifact)
    root = manifest.root
    if package_key is not None and manifest.raw["package_key"] != package_key:
        raise MoeprepError(f"{root} was prepared again while eval ran; its report.json is left as it is. "
                           "Run `moeprep eval` again on the new artifact")
    path, pending = manifest.path(REPORT), root / PENDING
    current = current_report(manifest)
    current |= sections
    data = (json.dumps(current, indent=2) + "\n").encode()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    extra = {}
    for name, content in (files or {}).items():
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
