"""Sweep reports: one table, one summary and one picture for a Hydra multirun directory.

    python -m mixhook.app.report <sweep_dir>

writes into ``<sweep_dir>``:

- ``summary.csv``: one row per run: its overrides (one column per key), status (``ok``, ``failed`` with the
  last line of its error, or ``incomplete`` for a run still going or killed), and its ``summary.json``
  metrics under their names and units (``test_acc``, ``test_ece``: fractions), plus ``test_error`` and
  ``best_test_error`` in %, with the paper's figure when the run's config carries one;
- ``summary.md``: runs grouped by their overrides other than ``seed``: n, mean ± std of test error (%)
  at the last and the best epoch, test NLL, test ECE (%) and, where the runs recorded it, balanced
  accuracy (%, the mean of the classes' accuracies: the long-tail figure), best first, beside the paper's
  figure;
  failed runs listed below;
- ``summary.png``: per group, each run's test error, the mean ± std at the last epoch, the mean at the
  best epoch and the paper's figure, beside the test ECE; the title says what was swept and how many
  runs failed;
- where the sweep holds a baseline (the one group whose every swept choice is ``none``: ``mixup=none``)
  and its runs share seeds with the others: each group's mean with its 95% interval, and its paired
  difference from the baseline over the seeds both ran (test error, NLL and ECE, each with its 95%
  interval, and whether the interval excludes 0), in ``summary.md`` and ``paired.png``.

:class:`ReportCallback` (configured in ``conf/config.yaml``) writes the report after every job of a
multirun and at its end, so a sweep in which some runs crashed is still reported.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from .files import atomic_write
from .records import ERROR_FILE

METRICS = [
    "test_acc", "test_error", "test_nll", "test_ece", "test_balanced_acc", "best_test_acc", "epochs",
    "seconds",
]  # fmt: skip
FAILED_DIR = ".failed"  # the sweep's failed jobs, one file each (mark_failed)
REGRESSION_METRICS = ["test_rmse", "best_test_rmse", "test_mse", "epochs", "seconds"]
# What a run's summary.json holds of its task (its "task": the app's Task names it) and what it is ranked by
TASK_METRICS = {"classification": (METRICS, "test_error"), "regression": (REGRESSION_METRICS, "test_rmse")}


def mark_failed(sweep_dir: str | os.PathLike, job: int, line: str) -> None:
    """A multirun job that failed says so in the sweep directory (``.failed/<job>.txt``), where
    :class:`ReportCallback` counts it at the sweep's end, whatever its own directory holds."""
    marks = Path(sweep_dir) / FAILED_DIR
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{job}.txt").write_text(f"{line}\n")


def run_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """The run directories of a sweep: those holding ``.hydra/overrides.yaml``, in job order."""
    found = [p.parent.parent for p in Path(sweep_dir).glob("**/.hydra/overrides.yaml")]

    def order(path: Path):
        rel = path.relative_to(sweep_dir).parts
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel)

    return sorted(found, key=order)


def read_run(run_dir: Path) -> dict:
    """One row: overrides, status, error line, metrics and the paper's figure (if any)."""
    import yaml

    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict = {"job": str(run_dir.name), "overrides": " ".join(overrides)}
    row.update(_parse_overrides(overrides))
    summary_file, error_file = run_dir / "summary.json", run_dir / ERROR_FILE
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        row["status"], row["error"] = "ok", ""
        row["task"] = task = summary.get("task", "classification")  # (written before the key: a classifier)
        if task not in TASK_METRICS:  # (not ranked: said in the run's row, the report goes on)
            row["status"], row["error"] = (
                "failed",
                f"summary.json: task {task!r} is not one of {list(TASK_METRICS)}",
            )
            return row
        for key in TASK_METRICS[task][0]:
            if key == "test_error":
                row[key] = 100.0 * (1.0 - summary["test_acc"])
            elif key in summary:  # as summary.json has it (test_acc, test_ece: fractions)
                row[key] = summary[key]
        if "best_test_acc" in summary:
            row["best_test_error"] = 100.0 * (1.0 - summary["best_test_acc"])
        for key, named in (summary.get("layers") or {}).items():  # each spec and the layers it named
            row[f"{key}.resolved"] = " ".join(f"{spec}={'|'.join(names)}" for spec, names in named.items())
        paper = summary.get("paper") or {}
        for key in ("metric", "value", "std", "source"):
            if key in paper:
                row[f"paper_{key}"] = paper[key]
    elif error_file.exists():
        lines = [line for line in error_file.read_text().splitlines() if line.strip()]
        row["status"], row["error"] = "failed", lines[-1] if lines else "failed"
    else:
        row["status"], row["error"] = "incomplete", ""
    return row


def _parse_overrides(overrides: list[str]) -> dict[str, str]:
    """``["+a.b=1", "seed=0"]`` -> ``{"a.b": "1", "seed": "0"}`` (Hydra's ``+``/``~`` prefixes dropped, and
    the escapes it writes into a sweep's values: ``stage\\:1`` is ``stage:1``)."""
    parsed = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if item:
            parsed[key.lstrip("+~")] = re.sub(r"\\(.)", r"\1", value)
    return parsed


def _override_items(row: dict) -> list[tuple[str, str]]:
    """A run's overrides other than ``seed``, in the order given."""
    return [(k, v) for k, v in _parse_overrides(row["overrides"].split(" ")).items() if k != "seed"]


def _varying_keys(rows: list[dict]) -> set[str]:
    """The override keys (other than ``seed``) whose values differ between runs, or that some runs
    lack: what was swept."""
    per_run = [dict(_override_items(row)) for row in rows]
    keys = {k for items in per_run for k in items}
    return {k for k in keys if len({items.get(k) for items in per_run}) > 1}


def _group_key(row: dict, varying: set[str]) -> str:
    return " ".join(f"{k}={v}" for k, v in _override_items(row) if k in varying) or "(all runs)"


def read_resolved(value: str) -> dict[str, list[str]]:
    """A ``<hook>.resolved`` cell of summary.csv (``"input=input stage:1=layer1"``, several names of one
    pattern joined by ``|``) as each spec's real layers."""
    out = {}
    for item in value.split():
        spec, _, names = item.partition("=")
        out[spec] = names.split("|")
    return out


def _spec_by_model(rows: list[dict], varying: set[str], regression: bool) -> list[str]:
    """Where a sweep crossed layer specs with models (``model=a,b mixup.layer=stage:1,stage:2``): a table,
    one row per spec and one column per model, each cell the mean ± std test error (or RMSE) of its runs
    and the real layer the spec named on that model (from each run's ``summary.json``)."""
    layer_keys = sorted(k for k in varying if k == "layer" or k.endswith(".layer"))
    model_keys = sorted(k for k in varying if k == "model" or k.startswith("model."))
    if len(layer_keys) != 1 or not model_keys:
        return []
    (layer_key,) = layer_keys
    hook = layer_key.rpartition(".")[0] or "mixup"

    def cell_of(row) -> tuple[str, str]:  # (its model, its spec)
        items = dict(_override_items(row))
        model = " ".join(f"{k}={items[k]}" for k in model_keys if k in items) or "(default)"
        return model, items.get(layer_key, "")

    cells_of = [cell_of(r) for r in rows]
    models = list(dict.fromkeys(model for model, _ in cells_of))
    specs = list(dict.fromkeys(spec for _, spec in cells_of))
    finished = [(r, at) for r, at in zip(rows, cells_of, strict=True) if r["status"] == "ok"]
    lines = [
        "", f"## {layer_key} by model", "",
        f"Mean ± std {'test RMSE' if regression else 'test error %'} (last epoch) of each spec on each "
        "model, with the real layer it named there.", "",
        "| " + " | ".join([layer_key, *models]) + " |", "| " + " | ".join(["---"] * (len(models) + 1)) + " |",
    ]  # fmt: skip
    for spec in specs:
        cells = [spec]
        for model in models:
            runs = [r for r, at in finished if at == (model, spec)]
            if not runs:
                cells.append("")
                continue
            mean, std = _mean_std([_score(r) for r in runs])
            named = [read_resolved(r.get(f"{hook}.resolved", "")) for r in runs]
            where = ", ".join(sorted({n for found in named for names in found.values() for n in names}))
            cells.append(f"{_pm(mean, std, 2)} (n={len(runs)}){f' `{where}`' if where else ''}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def groups(rows: list[dict], varying: set[str] | None = None) -> list[dict]:
    """Runs grouped by the swept overrides other than ``seed`` (those common to every run are left out
    of the label), best mean test error first, groups without a finished run last. Each group has its
    ``n`` finished runs, their per-run ``errors`` and mean ± std of test error (last and best epoch),
    NLL and ECE, and how many of its runs ``failed`` or are ``incomplete``. ``varying``:
    :func:`_varying_keys` of ``rows``, when the caller has it already."""
    varying = _varying_keys(rows) if varying is None else varying
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(_group_key(row, varying), []).append(row)
    out = []
    for key, runs in by_key.items():
        members = [r for r in runs if r["status"] == "ok"]
        errors = [_score(r) for r in members]
        err_mean, err_std = _mean_std(errors)
        best = [_score(r, "best_") for r in members if f"best_{_metric(r)}" in r]
        best_mean, best_std = _mean_std(best) if len(best) == len(members) else (math.nan, math.nan)
        nll_mean, nll_std = _mean_std([r["test_nll"] for r in members if "test_nll" in r])
        ece = [100.0 * r["test_ece"] for r in members if "test_ece" in r]  # in %, as the error
        ece_mean, ece_std = _mean_std(ece) if len(ece) == len(members) else (math.nan, math.nan)
        balanced = [100.0 * r["test_balanced_acc"] for r in members if r.get("test_balanced_acc") is not None]
        bal_mean, bal_std = _mean_std(balanced) if len(balanced) == len(members) else (math.nan, math.nan)
        paper = next((r for r in members if "paper_value" in r), None)
        out.append({
            "group": key, "n": len(members), "errors": errors,
            "metric": _metric(members[0]) if members else None,
            "test_error_mean": err_mean, "test_error_std": err_std,
            "best_error_mean": best_mean, "best_error_std": best_std,
            "test_nll_mean": nll_mean, "test_nll_std": nll_std,
            "test_ece_mean": ece_mean, "test_ece_std": ece_std,
            "balanced_acc_mean": bal_mean, "balanced_acc_std": bal_std,
            "failed": sum(r["status"] == "failed" for r in runs),
            "incomplete": sum(r["status"] == "incomplete" for r in runs),
            "paper": None if paper is None else {k[6:]: paper[k] for k in paper if k.startswith("paper_")},
        })  # fmt: skip
    return sorted(out, key=lambda g: (not g["n"], g["test_error_mean"] if g["n"] else 0.0))


def _metric(row: dict) -> str:
    """What a run is ranked by, by its task (:data:`TASK_METRICS`): ``test_error`` (%), or ``test_rmse`` for
    a regression run."""
    return TASK_METRICS[row.get("task") or "classification"][1]


def _score(row: dict, prefix: str = "") -> float:
    return row[f"{prefix}{_metric(row)}"]


def _regression(grouped: list[dict]) -> bool:
    return any(g["metric"] == "test_rmse" for g in grouped)


def _pm(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "—"
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def write_report(sweep_dir: str | os.PathLike) -> dict:
    """Write ``summary.csv``, ``summary.md`` and ``summary.png`` (and, with a baseline, ``paired.png``)
    into ``sweep_dir``; return the data."""
    sweep_dir = Path(sweep_dir)
    rows = [read_run(d) for d in run_dirs(sweep_dir)]
    varying = _varying_keys(rows)
    grouped = groups(rows, varying)
    compared = paired(rows, grouped, varying)
    _write_csv(sweep_dir / "summary.csv", rows)
    _write_atomic(sweep_dir / "summary.md", _markdown(sweep_dir, rows, grouped, varying, compared))
    _plot(sweep_dir / "summary.png", grouped, sweep_dir, varying, rows)
    if compared is not None:
        _plot_paired(sweep_dir / "paired.png", compared, sweep_dir)
    return {"rows": rows, "groups": grouped, "paired": compared}


PAIRED = (
    ("test_error", "test error %", 1.0),
    ("test_nll", "test NLL", 1.0),
    ("test_ece", "test ECE %", 100.0),
)


def interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The mean of ``values`` and the half-width of its ``level`` Student-t interval (``nan`` for fewer
    than two values)."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    from scipy.stats import t

    quantile = float(t.ppf(0.5 + level / 2, len(values) - 1))
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def paired(rows: list[dict], grouped: list[dict], varying: set[str]) -> dict | None:
    """Each group against the sweep's baseline, seed by seed: ``None`` where there is no baseline (the one
    finished group whose every swept choice is ``none``, as ``mixup=none``) or no other group shares two
    of its seeds. For each group: its runs' mean and 95% interval of test error (%), NLL and ECE (%), and
    its paired differences from the baseline (group minus baseline, over the seeds both finished) with
    their 95% intervals."""
    candidates = [
        g for g in grouped if g["n"] and g["group"] != "(all runs)"
        and all(value == "none" for value in _items(g["group"]).values())
    ]  # fmt: skip
    if len(candidates) != 1 or any(_metric(r) != "test_error" for r in rows if r["status"] == "ok"):
        return None
    base = candidates[0]["group"]
    members: dict[str, list[dict]] = {}  # each group's finished runs
    by_seed: dict[str, dict[str, dict]] = {}  # and its run of each seed (a seed run twice: the last)
    twice: list[str] = []
    for row in rows:
        seed = row.get("seed", _parse_overrides(row["overrides"].split(" ")).get("seed"))
        if row["status"] != "ok":
            continue
        key = _group_key(row, varying)
        members.setdefault(key, []).append(row)
        seeds = by_seed.setdefault(key, {})
        if seed is not None and str(seed) in seeds:  # (a rerun in the same directory)
            twice.append(f"`{key}` seed {seed}")
        if seed is not None:
            seeds[str(seed)] = row
    reference = by_seed.get(base, {})
    out = []
    for g in grouped:
        runs, paired_runs = members.get(g["group"], []), by_seed.get(g["group"], {})
        seeds = sorted(set(paired_runs) & set(reference), key=lambda s: (len(s), s))
        entry = {"group": g["group"], "n": len(runs), "pairs": len(seeds), "baseline": g["group"] == base}
        for key, _, scale in PAIRED:
            own = [scale * r[key] for r in runs if key in r]
            entry[key] = interval(own) if len(own) == len(runs) else (math.nan, math.nan)
            diffs = [
                scale * (paired_runs[s][key] - reference[s][key])
                for s in seeds
                if key in paired_runs[s] and key in reference[s]
            ]
            entry[f"{key}_diff"] = interval(diffs) if len(diffs) == len(seeds) else (math.nan, math.nan)
        if g["n"]:
            out.append(entry)
    if not any(e["pairs"] >= 2 and not e["baseline"] for e in out):
        return None
    return {"baseline": base, "groups": out, "twice": twice}


def _items(group: str) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in group.split(" "))


def resolved(mean: float, half: float) -> str:
    """Whether a paired difference's interval excludes 0, and which way."""
    if math.isnan(half):
        return "—"
    if mean - half > 0:
        return "higher"
    return "lower" if mean + half < 0 else "no"


def _paired_lines(compared: dict) -> list[str]:
    base = compared["baseline"]
    lines = [
        "", f"## Paired differences from `{base}`", "",
        f"Each group's mean with its 95% Student-t interval over its runs, and its paired difference from "
        f"`{base}` (the group's figure minus the baseline's, seed by seed over the seeds both finished) with "
        "its 95% interval; *resolved*: the interval excludes 0 (*lower* or *higher* than the baseline), "
        "else *no*. Last epoch, on the whole test set.", "",
        "| group | n | pairs | test error % | Δ test error | resolved | test NLL | Δ NLL | resolved "
        "| test ECE % | Δ ECE | resolved |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for e in compared["groups"]:
        cells = [f"`{e['group']}`" + (" (baseline)" if e["baseline"] else ""), str(e["n"]), str(e["pairs"])]
        for key, digits in (("test_error", 2), ("test_nll", 4), ("test_ece", 2)):
            cells.append(_ci(*e[key], digits))
            if e["baseline"]:
                cells += ["", ""]
            else:
                cells += [_ci(*e[f"{key}_diff"], digits, signed=True), resolved(*e[f"{key}_diff"])]
        lines.append("| " + " | ".join(cells) + " |")
    if compared.get("twice"):
        lines += ["", "Run more than once (each group's mean counts every run; the pairs take the last): "
                  + ", ".join(compared["twice"]) + "."]  # fmt: skip
    return lines


def _ci(mean: float, half: float, digits: int, signed: bool = False) -> str:
    if math.isnan(mean):
        return "—"
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return text + ("" if math.isnan(half) else f" ± {half:.{digits}f}")


def _write_atomic(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def _write_csv(path: Path, rows: list[dict]) -> None:
    fixed = ["job", "overrides"]
    keys = [k for row in rows for k in row if k not in fixed]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fixed + list(dict.fromkeys(keys)), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    _write_atomic(path, text.getvalue())


def _markdown(
    sweep_dir: Path, rows: list[dict], grouped: list[dict], varying: set[str], compared: dict | None = None
) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "incomplete")}
    common = sorted({f"{k}={v}" for r in rows for k, v in _override_items(r) if k not in varying})
    regression = _regression(grouped)
    what = "test RMSE" if regression else "test error"
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(rows)} runs: {counts['ok']} ok, {counts['failed']} failed, {counts['incomplete']} incomplete. "
        f"Groups are the runs' swept overrides other than `seed`, best mean {what} first; ± is the "
        "standard deviation over the group's runs. Last epoch: the model training ended with; best epoch: "
        f"each run's lowest {what} over its epochs, chosen on the test set (as some papers report: an "
        "optimistic figure). "
        + (
            "RMSE in the target's own units."
            if regression
            else "ECE: expected calibration error of the top-1 confidence, 15 equal-width bins."
            + (
                " Balanced accuracy: the mean of the classes' test accuracies."
                if any(not math.isnan(g["balanced_acc_mean"]) for g in grouped if g["n"])
                else ""
            )
        ),
        "",
        f"Common to every run: `{' '.join(common)}`." if common else "",
        "",
    ]
    if regression:
        lines += [
            "| group | n | test RMSE, last epoch | test RMSE, best epoch |",
            "| --- | --- | --- | --- |",
        ]
        for g in (g for g in grouped if g["n"]):
            lines.append(
                f"| {g['group']} | {g['n']} | {_pm(g['test_error_mean'], g['test_error_std'], 2)} | "
                f"{_pm(g['best_error_mean'], g['best_error_std'], 2)} |"
            )
    balanced = any(not math.isnan(g["balanced_acc_mean"]) for g in grouped if g["n"])
    lines += [] if regression or not any(g["n"] for g in grouped) else [
        "| group | n | test error %, last epoch | test error %, best epoch | test NLL, last epoch "
        "| test ECE %, last epoch |"
        + (" balanced accuracy %, last epoch |" if balanced else "")
        + " paper |",
        "| --- | --- | --- | --- | --- | --- |" + (" --- |" if balanced else "") + " --- |",
    ]  # fmt: skip
    for g in (g for g in grouped if g["n"] and not regression):
        paper = ""
        if g["paper"]:
            p = g["paper"]
            spread = f" ± {p['std']}" if "std" in p else ""
            paper = f"{p.get('value')}{spread} ({p.get('source', '')})"
        lines.append(
            f"| {g['group']} | {g['n']} | {_pm(g['test_error_mean'], g['test_error_std'], 2)} | "
            f"{_pm(g['best_error_mean'], g['best_error_std'], 2)} | "
            f"{_pm(g['test_nll_mean'], g['test_nll_std'], 4)} | "
            f"{_pm(g['test_ece_mean'], g['test_ece_std'], 2)} | "
            + (f"{_pm(g['balanced_acc_mean'], g['balanced_acc_std'], 2)} | " if balanced else "")
            + f"{paper} |"
        )
    lines += _spec_by_model(rows, varying, regression)
    if compared is not None:
        lines += _paired_lines(compared)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Runs without a result", "", "| job | overrides | status | error |"]
        lines += ["| --- | --- | --- | --- |"]
        lines += [f"| {r['job']} | {r['overrides']} | {r['status']} | {r['error']} |" for r in failed]
    return "\n".join(lines) + "\n"


def _draw_group(err_ax, ece_ax, yi: int, g: dict) -> None:
    """One group's row of :func:`_plot`: its runs' errors, their mean ± std and best-epoch mean, the
    paper's figure and the ECE; a group with no finished run says so."""
    if not g["n"]:
        err_ax.text(0.02, yi, "no finished run", va="center", color="#C44E52", fontsize=8,
                    transform=err_ax.get_yaxis_transform())  # fmt: skip
        return
    err_ax.scatter(g["errors"], [yi] * g["n"], s=12, color="#999999", zorder=2)
    std = 0.0 if math.isnan(g["test_error_std"]) else g["test_error_std"]
    err_ax.errorbar(g["test_error_mean"], yi, xerr=std, fmt="o", color="#4C72B0", capsize=4, zorder=3)
    err_ax.annotate(f"{g['test_error_mean']:.2f}", (g["test_error_mean"], yi), xytext=(0, 7),
                    textcoords="offset points", ha="center", fontsize=7)  # fmt: skip
    if not math.isnan(g["best_error_mean"]):
        err_ax.plot(g["best_error_mean"], yi, marker="o", mfc="none", color="#55A868", zorder=3)
    if g["paper"] and isinstance(g["paper"].get("value"), (int, float)):
        err_ax.plot(g["paper"]["value"], yi, marker="D", color="#C44E52", zorder=3)
    if not math.isnan(g["test_ece_mean"]):
        ece_std = 0.0 if math.isnan(g["test_ece_std"]) else g["test_ece_std"]
        ece_ax.errorbar(g["test_ece_mean"], yi, xerr=ece_std, fmt="s", color="#8172B2", capsize=4)


def _plot(path: Path, grouped: list[dict], sweep_dir: Path, varying: set[str], rows: list[dict]) -> None:
    """Two panels, one row per group (best first): test error (each run a dot, the mean ± std of the
    last epoch, the mean of the best epoch, the paper's figure) and test ECE; the axes span the values,
    not from 0, so that close groups are told apart; a group's failed and unfinished runs are counted in
    its label, and a group with none finished is drawn as such."""
    from .plots import pyplot

    plt = pyplot()

    height = 1.6 + 0.42 * max(len(grouped), 1)
    fig, (err_ax, ece_ax) = plt.subplots(
        1, 2, figsize=(11, height), dpi=120, sharey=True, gridspec_kw={"width_ratios": [3, 1.4]}
    )
    finished = [g for g in grouped if g["n"]]
    if finished:
        y = list(range(len(grouped)))
        labels = []
        for g in grouped:
            extra = "".join(f", {g[k]} {k}" for k in ("failed", "incomplete") if g[k])
            labels.append(f"{_short(g['group'])}  (n={g['n']}{extra})")
        for yi, g in enumerate(grouped):
            _draw_group(err_ax, ece_ax, yi, g)
        err_ax.set_yticks(y, labels)
        err_ax.set_ylim(len(grouped) - 0.5, -0.6)  # best first, at the top
        handles = [
            plt.Line2D([], [], marker="o", ls="", color="#4C72B0", label="last epoch, mean ± std"),
            plt.Line2D([], [], marker="o", ls="", mfc="none", color="#55A868", label="best epoch, mean"),
            plt.Line2D([], [], marker="o", ls="", ms=4, color="#999999", label="each run, last epoch"),
        ]
        if any(g["paper"] for g in grouped):
            handles.append(plt.Line2D([], [], marker="D", ls="", color="#C44E52", label="paper"))
        err_ax.legend(handles=handles, fontsize=7, loc="best")
        _pad(err_ax)
        _pad(ece_ax)
        err_ax.set_xlabel("test RMSE (the target's units)" if _regression(grouped) else "test error (%)")
        ece_ax.set_xlabel("test ECE (%)\nlast epoch, mean ± std")
        no_ece = "no ECE:\na regression task" if _regression(grouped) else None
        if no_ece is None and all(math.isnan(g["test_ece_mean"]) for g in finished):
            no_ece = "no ECE:\nnot recorded\nby these runs"
        if no_ece:  # no axis to read
            ece_ax.axis("off")
            ece_ax.text(0.5, 0.5, no_ece, ha="center", va="center", color="#777777",
                        transform=ece_ax.transAxes)  # fmt: skip
    else:  # nothing to draw on axes: say what happened instead
        counts = {s: sum(r["status"] == s for r in rows) for s in ("failed", "incomplete")}
        what = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no runs yet"
        for ax in (err_ax, ece_ax):
            ax.axis("off")
        fig.text(0.5, 0.45, f"no finished run ({what}):\nsee summary.md for each run's error", ha="center",
                 va="center", color="#C44E52")  # fmt: skip
    for ax in (err_ax, ece_ax):
        ax.grid(axis="x", alpha=0.3)
    seeds = sorted({dict(_parse_overrides(r["overrides"].split(" "))).get("seed", "") for r in rows} - {""})
    swept = ", ".join(sorted(varying)) or "nothing but the seed"
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "incomplete")}
    fig.suptitle(
        f"swept: {swept}" + (f"; seeds {', '.join(seeds)}" if seeds else "")
        + f"\n{len(rows)} runs: {counts['ok']} ok, {counts['failed']} failed, {counts['incomplete']} "
        f"incomplete   ({sweep_dir})", fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def _plot_paired(path: Path, compared: dict, sweep_dir: Path) -> None:
    """Three panels (test error, NLL, ECE): each group's paired difference from the baseline with its 95%
    interval, one row per group in the report's order, 0 (the baseline) marked; a resolved difference
    filled, an unresolved one hollow."""
    from .plots import pyplot

    plt = pyplot()
    others = [e for e in compared["groups"] if not e["baseline"]]
    fig, axes = plt.subplots(
        1, 3, figsize=(12, 1.4 + 0.38 * max(len(others), 1)), dpi=120, sharey=True
    )  # fmt: skip
    y = list(range(len(others)))
    for ax, (key, label, _) in zip(axes, PAIRED, strict=True):
        ax.axvline(0, color="#777777", lw=1)
        for yi, e in zip(y, others, strict=True):
            mean, half = e[f"{key}_diff"]
            if math.isnan(mean):
                continue
            filled = resolved(mean, half) in ("lower", "higher")
            ax.errorbar(mean, yi, xerr=0 if math.isnan(half) else half, fmt="o", capsize=3, color="#4C72B0",
                        mfc="#4C72B0" if filled else "white")  # fmt: skip
        ax.set_xlabel(f"Δ {label}\n(group − {compared['baseline']})")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, [f"{_short(e['group'])}  (pairs={e['pairs']})" for e in others])
    axes[0].set_ylim(len(others) - 0.5, -0.6)
    fig.suptitle(
        f"paired differences from {compared['baseline']}: mean and 95% interval over seeds "
        f"(filled: the interval excludes 0)\n({sweep_dir})", fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def _short(group: str) -> str:
    """A group's label for the picture: each float value to 4 significant digits (an Optuna trial's
    ``mixup.alpha=2.2403726653165665`` is ``mixup.alpha=2.24``); summary.md and summary.csv keep them
    whole."""
    parts = []
    for item in group.split(" "):
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            parts.append(item)
            continue
        short = f"{number:.4g}"
        parts.append(f"{key}{sep}{short}" if sep and len(short) < len(value) else item)
    return " ".join(parts)


def _pad(ax) -> None:
    """x limits around what is drawn, with a margin: a shared 0 would flatten close groups."""
    ax.relim()
    ax.autoscale_view(scalex=True, scaley=False)
    low, high = ax.get_xlim()
    margin = max(0.08 * (high - low), 0.05)
    ax.set_xlim(low - margin, high + margin)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra is a dependency of the app
    Callback = object


class ReportCallback(Callback):
    """Hydra callback: rewrite the sweep report after every job of a multirun and at its end, and end a
    sweep in which a job failed with one line and exit status 1."""

    def on_multirun_start(self, config, **kwargs) -> None:
        shutil.rmtree(Path(config.hydra.sweep.dir) / FAILED_DIR, ignore_errors=True)  # an earlier sweep's

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            write_report(hydra_cfg.sweep.dir)

    def on_multirun_end(self, config, **kwargs) -> None:
        """The final report; a sweep in which some run failed then ends with one line saying how many and
        where their errors are, and exit status 1 (each failed job printed its own line already). The
        count is of the jobs' own marks (:func:`mark_failed`), not of the report's rows: a job refused in
        a directory that held an earlier run left it as it was, and the report shows that run."""
        sweep_dir = config.hydra.sweep.dir
        rows = write_report(sweep_dir)["rows"]
        marks = Path(sweep_dir) / FAILED_DIR
        lines = [p.read_text() for p in marks.glob("*.txt")] if marks.is_dir() else []
        if any(line.startswith("stopped by ") for line in lines):
            return  # SIGINT/SIGTERM stopped the sweep (Hydra 1.4 calls this on the way out): its own status
        failed = len(lines)
        if failed:
            kept = failed - sum(r["status"] == "failed" for r in rows)
            where = f"their errors are listed in {sweep_dir}/summary.md" + (
                f" ({kept} refused in a directory that holds an earlier run, left as it was: see above)"
                if kept > 0 else ""
            )  # fmt: skip
            print(f"error: {failed} of {max(len(rows), failed)} runs failed; {where}", file=sys.stderr)
            raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    try:  # the app extra: without it, say what to install (as mixhook-layers does)
        import matplotlib  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as err:
        print(
            f"error: sweep reports are part of the experiment app, which needs {err.name}: "
            "pip install 'mixhook[app]'",
            file=sys.stderr,
        )
        return 2
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m mixhook.app.report <sweep_dir>", file=sys.stderr)
        return 2
    sweep_dir = Path(args[0])
    if not sweep_dir.is_dir() or not run_dirs(sweep_dir):
        print(
            f"error: {sweep_dir} is not a sweep directory (no */.hydra/overrides.yaml below it)",
            file=sys.stderr,
        )
        return 2
    data = write_report(sweep_dir)
    counts = f"{len(data['rows'])} runs, {len(data['groups'])} groups"
    print(f"{counts} -> {sweep_dir}/summary.csv, summary.md, summary.png")
    print((sweep_dir / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
