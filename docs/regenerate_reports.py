"""Rewrite the sweep reports committed under docs/ with today's report code (mixhook/app/report.py), from
each report's own summary.csv: one row per run with its overrides, status and metrics, which is all the
report reads from a run directory. So the committed summary.md, summary.png and summary.csv keep the
layout and units the code writes now, without rerunning the sweeps.

    python docs/regenerate_reports.py           # rewrite every report under docs/
    python docs/regenerate_reports.py --check   # exit 1 naming each summary.md the code would write otherwise

The suite runs the check (tests/e2e/test_report.py): change the report's layout, then run this.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from mixhook.app.records import ERROR_FILE
from mixhook.app.report import read_resolved, write_report

DOCS = Path(__file__).resolve().parent
SUMMARY_KEYS = (  # what summary.json holds that the report reads
    "test_acc", "test_nll", "test_ece", "test_balanced_acc", "best_test_acc", "epochs", "seconds",
    "test_rmse", "best_test_rmse", "test_mse", "seed",
)  # fmt: skip


def reports(root: Path = DOCS) -> list[Path]:
    """The directories under ``root`` that hold a sweep report (summary.csv beside summary.md)."""
    return sorted(p.parent for p in root.rglob("summary.csv") if (p.parent / "summary.md").exists())


def _number(text: str):
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def rebuild(report: Path, scratch: Path) -> Path:
    """The sweep directory ``report``'s summary.csv describes, rebuilt under ``scratch`` at the path its
    summary.md names (the report's title), then reported on; returns it."""
    title = (report / "summary.md").read_text().splitlines()[0]
    sweep = scratch / title.removeprefix("# Sweep report: ")
    for i, row in enumerate(csv.DictReader(open(report / "summary.csv", newline=""))):
        run = sweep / str(i) / row["job"]  # a report may hold several sweeps, whose job numbers repeat
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(row["overrides"].split(" ")))
        if row["status"] == "ok":
            summary = {k: _number(row[k]) for k in SUMMARY_KEYS if row.get(k, "") != ""}
            summary["task"] = row["task"]  # (the run's own, as its summary.json said)
            paper = {k[6:]: row[k] for k in row if k.startswith("paper_") and row[k] != ""}
            for key in ("value", "std"):
                if key in paper:
                    paper[key] = _number(paper[key])
            summary["paper"] = paper or None
            summary["layers"] = {  # each hook's specs and the layers they named: "stage:1=layer1 ..."
                key.removesuffix(".resolved"): read_resolved(value)
                for key, value in row.items()
                if key.endswith(".resolved") and value
            }
            (run / "summary.json").write_text(json.dumps(summary))
        elif row["status"] == "failed":
            (run / ERROR_FILE).write_text(f"{row['error']}\n")
    here = Path.cwd()
    os.chdir(scratch)  # the title names the sweep directory as it was given: relative
    try:
        write_report(sweep.relative_to(scratch))
    finally:
        os.chdir(here)
    return sweep


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python docs/regenerate_reports.py [--check]", file=sys.stderr)
        return 2
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, report in enumerate(reports()):
            sweep = rebuild(report, Path(tmp) / str(i))
            if (sweep / "summary.md").read_text() != (report / "summary.md").read_text():
                stale.append(report)
            if not check:
                for name in ("summary.csv", "summary.md", "summary.png", "paired.png"):
                    if (sweep / name).exists():
                        shutil.copyfile(sweep / name, report / name)
                    elif (report / name).exists():  # (a picture the report no longer draws)
                        (report / name).unlink()
    for report in stale:
        name = f"{report.relative_to(DOCS.parent)}/summary.md"
        if check:
            print(f"{name} is not what the report code writes now: run python docs/regenerate_reports.py",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"{name} was not what the report code writes now: rewritten", file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
