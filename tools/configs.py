"""Every shipped ``mixup=`` config on the README's default run, and its table: ``python -m tools.configs``.

Each config of ``mixhook/app/conf/mixup/`` trains as ``python train.py mixup=<name>`` trains it (15 epochs of
PreActResNet-18 on digits), or, for a config the default data or model cannot take, with the overrides its
one-line refusal names (the matrix's: a ViT for TransMix and MixPro, regression data for C-Mixup). Each
run is a ``train.py`` process of its own (``--jobs`` at a time, their threads shared out), in a run
directory under ``--out`` that a later call reuses: a run whose ``summary.json`` exists is not run again,
so an interrupted table continues where it stopped. ``docs/configs.md`` gets one row per config: its final
and best test accuracy (RMSE for regression), test ECE, seconds, and whether it is within
:data:`MARGIN` points of ``mixup=none`` on the same data; a run that failed or diverged says so with its
last line. ``--epochs``/``--only`` make a quick partial table (not written to docs/ unless ``--write``);
``--only ... --update`` runs those configs (and their settings' baselines) and puts their rows into the
committed table, keeping every other row as it was measured (:func:`measured`), the header saying which
rows are of which day.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "mixhook" / "app" / "conf" / "mixup"
TABLE = ROOT / "docs" / "configs.md"
MARGIN = 3.0  # points of test accuracy below mixup=none that a config may lose and still "train"


def configs() -> list[str]:
    """The shipped ``mixup=`` configs, ``none`` first (the others are compared with it)."""
    names = sorted(p.stem for p in CONF.glob("*.yaml"))
    return ["none", *[n for n in names if n != "none"]]


def overrides(name: str) -> tuple[str, ...]:
    """What a config needs beyond ``mixup=<name>`` on the default experiment (the matrix's ``where``: the
    overrides its one-line refusal names)."""
    from tests.matrix.methods import METHODS

    return next((m.where for m in METHODS if m.app == name), ())


def setting(where: tuple[str, ...]) -> tuple[str, ...]:
    """The overrides of ``where`` that choose the model and data (``mixup.*`` ones configure the method):
    what ``mixup=none`` runs with beside it."""
    return tuple(w for w in where if not w.startswith("mixup."))


def train(name: str, where: tuple[str, ...], out: Path, epochs: int | None, threads: int) -> dict:
    """One config's run with ``where`` (reused where its summary exists: then ``"reused": True``): its
    summary, or its last line on failure."""
    run = out / "-".join([name, *(w.split("=")[-1].replace("/", "_") for w in where)])
    summary = run / "summary.json"
    if summary.exists():
        return {"name": name, "where": where, "reused": True, **json.loads(summary.read_text())}
    command = [
        sys.executable, str(ROOT / "train.py"), f"mixup={name}", *where,
        "trainer.progress_bar=false", f"trainer.threads={threads}", f"hydra.run.dir={run}",
        *([f"trainer.epochs={epochs}"] if epochs else []),
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0 or not summary.exists():
        lines = result.stderr.strip().splitlines() or ["(no output)"]
        seconds = time.perf_counter() - started
        return {"name": name, "where": where, "failed": lines[-1], "seconds": seconds}
    return {"name": name, "where": where, **json.loads(summary.read_text())}


def row(found: dict, none: dict | None) -> str:
    """The table's row of one run (``none``: ``mixup=none`` on the same model and data)."""
    name, where = found["name"], " ".join(found["where"])
    command = f"`mixup={name}{' ' + where if where else ''}`"
    if "failed" in found:
        return f"| {command} | | | | {found['seconds']:.0f} | **failed**: {found['failed']} |"
    if found.get("task") == "regression":
        return (
            f"| {command} | {found['test_rmse']:.3f} | {found['best_test_rmse']:.3f} | "
            f"{found['seconds']:.0f} | {'the baseline' if name == 'none' else 'regression: beside none'} |"
        )
    acc, best, ece = 100 * found["test_acc"], 100 * found["best_test_acc"], 100 * found["test_ece"]
    if name == "none":
        verdict = "the baseline"
    elif none is None or "test_acc" not in none:
        verdict = "(mixup=none not run)"
    elif acc >= 100 * none["test_acc"] - MARGIN:
        verdict = "trains"
    else:
        verdict = f"**{100 * none['test_acc'] - acc:.1f} points below none**"
    return f"| {command} | {acc:.2f} | {best:.2f} | {ece:.2f} | {found['seconds']:.0f} | {verdict} |"


VIT = ("experiment=vit_digits",)  # (the app's ViT recipe: TransMix's and MixPro's setting)
# Configs run in a setting beside those whose refusal names it, with their overrides: what a reader
# compares that setting's methods with (the ViT methods with CutMix, and TokenMix on the patch grid)
BESIDE = {VIT: (("cutmix", ()), ("tokenmix", ("mixup.grid=4",)))}

# Each setting's section: its title, and what a reader needs beside its rows that they do not say
SECTIONS = {
    (): ("PreActResNet-18 on digits, the default run", ""),
    ("data=diabetes", "model=mlp"): (
        "An MLP on the diabetes data (regression)",
        "RMSE in the target's units (lower is better); *best* is the lowest of any epoch.",
    ),
    VIT: (
        "A ViT on digits (`experiment=vit_digits`)",
        "timm's ViT-Tiny on 2x2 patches with the recipe a ViT user would choose: AdamW (weight decay 0.05), "
        "a 3-epoch linear warm-up into the cosine schedule, learning rate 1e-3, the best of a short sweep "
        "(15 epochs; `mixup=none` ended at 79.2, 81.7 and 56.7% and `mixup=cutmix` at 76.7, 82.2 and 43.1% "
        "with 5e-4, 1e-3 and 2e-3). The ViT methods are compared with CutMix as well as with `mixup=none`: "
        "TokenMix runs on the patch grid (`mixup.grid=4`: cells of one 2x2 patch). The default run's SGD at "
        "0.05 had left the ViT near chance for six epochs and plain CutMix at 16.4%. SMMix ends below both: "
        "on this 4x4 patch grid its window is 1 to 3 patches a side (up to 56% of an 8x8 digit), and it "
        "moves the partner's most attended patches into the sample's least attended place while the label "
        "weighs them by area. Its own terms are not the cause (one run each: 73.1% without the consistency "
        "term, `mixup.consistency=0`; 73.3% without the token head's, `mixup.fine=0`), nor is the authors' "
        "switch with input mixup on half the batches (75.0%, `OneOf`, where input mixup alone reaches "
        "85.0%); its equality with the authors' lines is tested (tests/unit/test_smmix.py). MergeMix's row "
        "is its mix alone: the authors' step adds a second forward of plain input mixup (alpha 0.8), which "
        "the app's one-forward step does not run (a `OneOf` pinned to each in turn is that step in a loop "
        "of your own; tests/unit/test_mergemix.py).",
    ),
}


def plan(names: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The runs of the table of ``names``: each config with its overrides, the configs run beside them
    (:data:`BESIDE`), and ``mixup=none`` in every setting other than the default (each model's and data's
    baseline)."""
    runs = [(n, overrides(n)) for n in names]
    runs += [
        (name, (*where, *extra))
        for where, beside in BESIDE.items()
        if any(setting(w) == where for _, w in runs)
        for name, extra in beside
    ]
    return runs + [("none", w) for w in dict.fromkeys(setting(w) for _, w in runs if setting(w))]


ROW = re.compile(r"^\| `mixup=(?P<name>[^ `]+)(?: (?P<where>[^`]+))?` \| (?P<cells>.*) \|$")
HEADER = re.compile(r"^`python -m tools\.configs` on (?P<on>.*\)): `python train\.py")


def measured(text: str) -> tuple[list[dict], str]:
    """The results a committed table shows (as :func:`train` returns them, to its rounding) and its
    header's "on ... (machine)" words: what ``--update`` keeps of the rows it does not run again."""
    results = []
    for line in text.splitlines():
        found = ROW.match(line)
        if found is None:
            continue
        where = tuple(found["where"].split()) if found["where"] else ()
        cells = [c.strip() for c in found["cells"].split("|")]
        result = {"name": found["name"], "where": where}
        if cells[-1].startswith("**failed**: "):
            result.update(failed=cells[-1].removeprefix("**failed**: "), seconds=float(cells[-2]))
        elif len(cells) == 4:  # (regression: RMSE, best, seconds, verdict)
            result.update(task="regression", test_rmse=float(cells[0]), best_test_rmse=float(cells[1]))
            result.update(seconds=float(cells[2]))
        else:
            acc, best, ece, seconds = (float(c) for c in cells[:4])
            result.update(test_acc=acc / 100, best_test_acc=best / 100, test_ece=ece / 100, seconds=seconds)
        results.append(result)
    header = next((HEADER.match(line) for line in text.splitlines() if HEADER.match(line)), None)
    return results, "" if header is None else header["on"]


def rerun_header(earlier: str, updated: tuple[str, ...], on: str) -> str:
    """The header's "on ..." words after ``--update`` reran the rows ``updated`` ``on`` a day: the first
    run's, then each later run's rows that it still holds (a row run again moves to the newest; rows run
    on the day and machine of the newest run join its group)."""
    base, *parts = earlier.split("; the rows of ")
    runs = []
    for part in parts:
        rows, when = part.rsplit(" on ", 1)
        left = [row for row in re.findall(r"`([^`]+)`", rows) if row not in updated]
        if left:
            runs.append((left, when))
    if runs and runs[-1][1] == on:  # (the same day and machine as the newest run: one group)
        runs[-1] = ([*runs[-1][0], *updated], on)
    else:
        runs.append((list(updated), on))
    return base + "".join(
        f"; the rows of {', '.join(f'`{r}`' for r in rows)} on {when}" for rows, when in runs
    )


def merged(kept: list[dict], results: list[dict], whole: set) -> tuple[list[dict], tuple[str, ...]]:
    """``--update``'s rows and the configs it ran: the rows of ``results`` it made (run now, or reused
    from a run directory where the committed table has no row of them yet) beside the table's ``kept``
    rows of the rest of the ``whole`` plan. A run reused where the table has its row keeps that row and
    the day the table gives it (the run beside a method, TokenMix beside TLA, is the earlier run's)."""
    shown = {(r["name"], r["where"]) for r in kept}
    made = [r for r in results if not (r.get("reused") and (r["name"], r["where"]) in shown)]
    mine = {(r["name"], r["where"]) for r in made}
    rows = [r for r in kept if (r["name"], r["where"]) in whole - mine] + made
    return rows, tuple(" ".join((f"mixup={r['name']}", *r["where"])) for r in made)


def table(results: list[dict], epochs: int | None, earlier: str = "", updated: tuple[str, ...] = ()) -> str:
    """docs/configs.md from ``results``; ``earlier`` (the words :func:`measured` read) and ``updated`` (the
    configs run again) when rows of two days are shown."""
    baselines = {setting(r["where"]): r for r in results if r["name"] == "none"}
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    on = f"{date.today()} ({machine})"
    if updated:
        on = rerun_header(earlier, updated, on)
    lines = [
        "# Every shipped config on the default run",
        "",
        f"`python -m tools.configs` on {on}: `python train.py mixup=<name>` for",
        f"each config, {epochs or 15} epoch(s) of PreActResNet-18 on digits (the README's run); a config",
        "the default data or model cannot take runs with the overrides its one-line refusal names, beside",
        "`mixup=none` with the same model and data (the method's own `mixup.*` overrides left out).",
        "Accuracy and ECE in %, of the last epoch; *best*: the best epoch's. A config trains",
        f"when it ends within {MARGIN:g} points of `mixup=none` on the same model and data. *Seconds*: each",
        "run's wall time while two runs shared the two cores (the README's run alone takes about 47 s).",
    ]
    groups: dict[tuple, list[dict]] = {}
    for found in results:
        groups.setdefault(setting(found["where"]), []).append(found)
    for where in sorted(groups, key=lambda w: (w != (), " ".join(w))):
        title, note = SECTIONS.get(where, (f"With `{' '.join(where)}`", ""))
        runs = sorted(groups[where], key=lambda r: (r["name"] != "none", r["name"]))  # (the baseline first)
        regression = any(r.get("task") == "regression" for r in runs)
        head = (
            ["| config | test RMSE | best | seconds | |", "| --- | ---: | ---: | ---: | --- |"]
            if regression
            else [
                "| config | test accuracy | best | test ECE | seconds | against `mixup=none` |",
                "| --- | ---: | ---: | ---: | ---: | --- |",
            ]
        )
        lines += ["", f"## {title}", "", *([note, ""] if note else []), *head]
        lines += [row(r, baselines.get(where)) for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.configs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "multirun" / "configs", help="run directories")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (threads shared among them)")
    parser.add_argument("--epochs", type=int, default=None, help="fewer epochs: a quick, partial table")
    parser.add_argument("--only", default="", help="comma-separated configs (default: all)")
    parser.add_argument("--write", action="store_true", help="write docs/configs.md even for a partial run")
    parser.add_argument(
        "--update", action="store_true", help="with --only: put those configs' rows into docs/configs.md"
    )
    args = parser.parse_args(argv)
    if args.update and (not args.only or args.epochs):
        parser.error(
            "--update puts whole runs of the configs --only names into the table: give --only, not --epochs"
        )
    names = configs()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: no config {', '.join(unknown)}; the configs: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    threads = max((os.cpu_count() or 1) // args.jobs, 1)
    out = args.out / (f"epochs{args.epochs}" if args.epochs else "default")
    runs = plan(names)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: train(*job, out, args.epochs, threads), runs))
    if args.update:
        kept, earlier = measured(TABLE.read_text())
        results, rerun = merged(kept, results, set(plan(configs())))  # (a row not in the plan goes)
        text = table(results, None, earlier, rerun) if rerun else TABLE.read_text()
    else:
        text = table(results, args.epochs)
    print(text, end="")
    if args.write or args.update or (not args.epochs and not args.only):
        TABLE.write_text(text)
        print(f"wrote {TABLE.relative_to(ROOT)}", file=sys.stderr)
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
