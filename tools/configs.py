"""Every shipped ``mixup=`` config on the README's default run, and its table: ``python -m tools.configs``;
and on the Fashion-MNIST study's setting beside ERM's seed spread: ``python -m tools.configs
--fashion-mnist``.

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

``--fashion-mnist`` runs each config once (seed 0) on the setting of docs/fashion_mnist_study
(``experiment=fashion_mnist_study``), reusing the study's own runs where it has the config, and writes the
section of docs/configs.md between its markers: each config's test error, NLL and ECE beside ERM's five
seeds (their mean, spread and seed 0's), and whether it lies outside their spread. A config this setting
cannot take (a ViT's attention, regression targets) or that would not end in hours here is listed with why.
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
    from harness.matrix.methods import METHODS

    return next((m.where for m in METHODS if m.app == name), ())


def setting(where: tuple[str, ...]) -> tuple[str, ...]:
    """The overrides of ``where`` that choose the model and data (``mixup.*`` ones configure the method):
    what ``mixup=none`` runs with beside it."""
    return tuple(w for w in where if not w.startswith("mixup."))


def train(name: str, where: tuple[str, ...], out: Path, epochs: int | None, threads: int) -> dict:
    """One config's run with ``where`` (reused where its summary exists: then ``"reused": True``; an
    interrupted one, its checkpoint there and no summary, continued exactly: ``trainer.resume=auto``): its
    summary, or its last line on failure."""
    run = out / "-".join([name, *(w.split("=")[-1].replace("/", "_") for w in where)])
    summary = run / "summary.json"
    if summary.exists():
        return {"name": name, "where": where, "reused": True, **json.loads(summary.read_text())}
    command = [
        sys.executable, str(ROOT / "train.py"), f"mixup={name}", *where,
        "trainer.progress_bar=false", f"trainer.threads={threads}", f"hydra.run.dir={run}",
        *([f"trainer.epochs={epochs}"] if epochs else []),
        *(["trainer.resume=auto"] if (run / "last.pt").exists() else []),
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
        "85.0%); its equality with the authors' lines is tested (tests/mixers/test_smmix.py). MergeMix's row "
        "is its mix alone: the authors' step adds a second forward of plain input mixup (alpha 0.8), which "
        "the app's one-forward step does not run (a `OneOf` pinned to each in turn is that step in a loop "
        "of your own; tests/mixers/test_mergemix.py).",
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
    header's "on ... (machine)" words: what ``--update`` keeps of the rows it does not run again. The
    Fashion-MNIST section's rows (between its markers) are not the table's: left out."""
    text = main_table(text)
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


def main_table(text: str) -> str:
    """docs/configs.md's text without its Fashion-MNIST section (``--fashion-mnist``'s, between its
    markers)."""
    if BEGIN not in text:
        return text
    before, _, rest = text.partition(BEGIN)
    return before + rest.partition(END)[2]


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


# ------------------------------------------------------------------------------ the Fashion-MNIST section

STUDY = ROOT / "multirun" / "fashion_mnist_study"  # docs/fashion_mnist_study/run.sh's sweep
FASHION = ("experiment=fashion_mnist_study",)
# What a shipped config needs to run on 28x28 images, as the study runs it: PuzzleMix's CIFAR cells (4
# pixels) do not tile its 14- and 7-pixel blocks; Local Mixup's epsilon is a distance at the input, set
# for digits (8.0, about a random pair's median there, 8.2): Fashion-MNIST's pairs are farther apart
# (median 32.9 over 2,000 training images normalised as the app does), so every pair would weigh 0
FASHION_FIXES = {
    "puzzlemix": ("mixup.neigh_size=7", "mixup.t_size=7"),
    "localmixup": ("mixup.policies.weights.epsilon=32.0",),
}
# Configs not run on this setting, and why (a step measured on it, 2026-12-07: mixup=none takes 0.2 s)
FASHION_NOT_RUN = {
    "comixup": "not run: 7 s a training step here (35 times mixup=none: about 2 hours a run on one thread), "
    "its labelling over 28x28 images; it trains on digits above",
}
BEGIN, END = (
    "<!-- fashion-mnist: written by python -m tools.configs --fashion-mnist -->",
    "<!-- fashion-mnist end -->",
)


def study_runs(study: Path = STUDY) -> list[dict]:
    """The study's finished runs: each one's overrides (but its seed and experiment), seed and summary."""
    import yaml

    found = []
    for path in sorted(study.glob("**/summary.json")):
        overrides = yaml.safe_load((path.parent / ".hydra" / "overrides.yaml").read_text())
        seed = next((int(o.split("=")[1]) for o in overrides if o.startswith("seed=")), 0)
        rest = tuple(o for o in overrides if not o.startswith(("seed=", "experiment=")))
        found.append({"overrides": rest, "seed": seed, **json.loads(path.read_text())})
    return found


def erasing_configs() -> list[str]:
    """The shipped ``erasing=`` configs but ``none``."""
    return sorted(p.stem for p in (CONF.parent / "erasing").glob("*.yaml") if p.stem != "none")


def fashion_plan(names: list[str]) -> list[tuple[str, tuple[str, ...] | None, str]]:
    """Each config's run on the study's setting: ``(name, its overrides, "")`` (``erasing=<name>`` beside
    ``mixup=none`` for the erasing configs), or ``(name, None, why)`` for one this setting cannot take or
    that is not run."""
    plan = []
    for name in names:
        where = setting(overrides(name))
        if name.startswith("erasing="):
            plan.append(("none", (name,), ""))
        elif "experiment=vit_digits" in where:
            plan.append((name, None, "n/a: each reads a ViT's attention, and the setting's model is a CNN"))
        elif "data=diabetes" in where:
            plan.append((name, None, "n/a: mixes regression targets, and Fashion-MNIST has classes"))
        elif name in FASHION_NOT_RUN:
            plan.append((name, None, FASHION_NOT_RUN[name]))
        else:
            plan.append((name, FASHION_FIXES.get(name, ()), ""))
    return plan


def fashion_result(name: str, extra: tuple[str, ...], studied: list[dict], out: Path, threads: int) -> dict:
    """Seed 0 of ``mixup=<name>`` with ``extra``: the study's run where it has one (the study runs the
    erasing configs without a mixup override), else a run of its own."""
    wanted = set(extra) | ({f"mixup={name}"} if not (name == "none" and extra) else set())
    for run in studied:
        if run["seed"] == 0 and set(run["overrides"]) == wanted:
            return {**run, "name": name, "where": extra, "from_study": True}
    return train(name, (*FASHION, "seed=0", *extra), out, None, threads) | {"where": extra}


def fashion_section(plan: list, results: dict, baseline: list[dict]) -> str:
    """The section: ERM's spread, then one row per config (its seed-0 run, or why there is none)."""
    import statistics

    errors = [100 * (1 - r["test_acc"]) for r in sorted(baseline, key=lambda r: r["seed"])]
    mean, std = statistics.fmean(errors), statistics.stdev(errors)
    seed0 = next(100 * (1 - r["test_acc"]) for r in baseline if r["seed"] == 0)
    lines = [
        BEGIN, "", "## Fashion-MNIST, the study's setting", "",
        f"`python -m tools.configs --fashion-mnist` on {date.today()}: each shipped config once (seed 0) on "
        "the setting of the [Fashion-MNIST study](fashion_mnist_study/README.md) "
        "(`experiment=fashion_mnist_study`: PreActResNet-18 a quarter wide, 1,000 training images of each "
        "class, 12 epochs, the whole 10,000-image test set; the study's own runs where it has the config), "
        f"beside ERM's five seeds: test error {mean:.2f} ± {std:.2f} % (mean ± std; {min(errors):.2f} to "
        f"{max(errors):.2f}; seed 0: {seed0:.2f}). "
        "One seed says where a config lands, not whether it helps: a difference from ERM within two of its "
        "standard deviations is *within* ERM's spread, else *below* or *above* it (in brackets: the "
        "difference from ERM's mean); the study's paired differences over five seeds are "
        "what resolves one. Test error, NLL and ECE of the last epoch; *seconds*: the run's wall time beside "
        "another run on the two cores.", "",
        "| config | test error % | against ERM (seed 0) | test NLL | test ECE % | seconds | ERM's spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]  # fmt: skip
    reasons: dict[str, list[str]] = {}  # (why a config has no figures: said once, under the table)
    for name, fixes, why in plan:
        shown = [*(() if fixes and fixes[0].startswith("erasing=") else (f"mixup={name}",)), *(fixes or ())]
        command = f"`{' '.join(shown)}`"
        if fixes is None:
            kind, _, because = why.partition(": ")
            reasons.setdefault(because, []).append(command)
            lines.append(f"| {command} | | | | | | {kind} (below) |")
            continue
        found = results[(name, fixes)]
        if "failed" in found:
            lines.append(f"| {command} | | | | | {found['seconds']:.0f} | **failed**: {found['failed']} |")
            continue
        error = 100 * (1 - found["test_acc"])
        side = "below" if error < mean else "above"
        verdict = "ERM, seed 0" if name == "none" and not fixes else (
            "within" if abs(error - mean) <= 2 * std else f"**{side}** ({error - mean:+.2f})"
        )  # fmt: skip
        lines.append(
            f"| {command} | {error:.2f} | {error - seed0:+.2f} | {found['test_nll']:.4f} | "
            f"{100 * found['test_ece']:.2f} | {found['seconds']:.0f} | {verdict} |"
        )
    notes = [f"- {', '.join(commands)}: {because}." for because, commands in reasons.items()]
    return "\n".join([*lines, *([""] + notes if notes else []), "", END]) + "\n"


def with_section(text: str, section: str) -> str:
    """docs/configs.md's ``text`` with its Fashion-MNIST section replaced by ``section`` (appended where it
    has none)."""
    if BEGIN in text:
        head, _, rest = text.partition(BEGIN)
        return head + section + rest.partition(END)[2].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + section


def fashion_mnist(args, threads: int) -> int:
    """``--fashion-mnist``: run what the section needs (``--jobs`` at a time) and write it."""
    studied = study_runs(args.study)
    baseline = [r for r in studied if r["overrides"] == ("mixup=none",)]
    if len({r["seed"] for r in baseline}) < 5:
        print(f"--fashion-mnist needs the study's five mixup=none runs in {args.study} "
              "(bash docs/fashion_mnist_study/run.sh)", file=sys.stderr)  # fmt: skip
        return 2
    names = [*configs(), *(f"erasing={e}" for e in erasing_configs())]
    plan = fashion_plan(names if not args.only else [n for n in names if n in args.only.split(",")])
    out = args.out / "fashion_mnist"
    runs = [(name, fixes) for name, fixes, _ in plan if fixes is not None]
    with ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(lambda job: fashion_result(*job, studied, out, threads), runs))
    results = {(r["name"], tuple(r["where"])): r for r in found}
    section = fashion_section(plan, results, baseline)
    print(section, end="")
    if not args.only:
        TABLE.write_text(with_section(TABLE.read_text(), section))
        print(f"wrote {TABLE.relative_to(ROOT)}", file=sys.stderr)
    return 1 if any("failed" in r for r in found) else 0


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
    parser.add_argument(
        "--fashion-mnist",
        action="store_true",
        help="on the Fashion-MNIST study's setting, beside ERM's seeds",
    )
    parser.add_argument("--study", type=Path, default=STUDY, help="the study's sweep directory")
    args = parser.parse_args(argv)
    if args.update and (not args.only or args.epochs):
        parser.error(
            "--update puts whole runs of the configs --only names into the table: give --only, not --epochs"
        )
    names = (
        configs() if not args.fashion_mnist else [*configs(), *(f"erasing={e}" for e in erasing_configs())]
    )
    if args.fashion_mnist and (args.epochs or args.update or (args.only and args.write)):
        parser.error(
            "--fashion-mnist runs the study's setting as it is and writes its whole section: not with "
            "--epochs, --update, or --write beside --only (a partial section is printed only)"
        )
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: no config {', '.join(unknown)}; the configs: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    threads = max((os.cpu_count() or 1) // args.jobs, 1)
    if args.fashion_mnist:
        return fashion_mnist(args, threads)
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
        earlier = TABLE.read_text()
        if BEGIN in earlier:  # (the Fashion-MNIST section is --fashion-mnist's: kept as it is)
            text = with_section(text, BEGIN + earlier.partition(BEGIN)[2].partition(END)[0] + END + "\n")
        TABLE.write_text(text)
        print(f"wrote {TABLE.relative_to(ROOT)}", file=sys.stderr)
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
