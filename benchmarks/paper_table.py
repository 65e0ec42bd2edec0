"""A paper's table on one GPU: several of the app's paper recipes trained at once, their test error
beside the paper's figures.

    python benchmarks/paper_table.py [--recipes a,b] [--seeds 0,1] [--epochs N] [--jobs N] [--data-root DIR]
                                     [--device cuda|cpu] [--budget SECONDS] [--out benchmarks/results]

Each (recipe, seed) is a ``train.py`` run of its own: the recipe as its experiment config writes it, with
``--epochs`` (a shortened run: the schedule's milestones scaled alike, ``[150, 225]`` of 300 epochs becoming
``[15, 22]`` of 30) and the data under ``--data-root``. ``--jobs`` of them run at once on the one device (a
ResNet-20 at batch 128 leaves an H100 mostly idle: one process keeps it busy a fraction of the time), each
with its share of the CPU's threads. No run starts once ``--budget`` seconds have passed; those that ran
are reported. The default recipes are Random Erasing's Fashion-MNIST table (Zhong et al. 2020: ResNet-20
and ResNet-32, with and without Random Erasing).

Writes the run directories under ``<out>/paper-table/`` (or ``--runs``; their sweep report:
``summary.md``, ``summary.csv``) and ``<out>/<device>-<date>-paper-table.{json,md}``: per recipe the runs'
test error (last and best epoch, mean ± std), the paper's figure, and each recipe with Random Erasing
against its baseline (the paired difference over the seeds both ran). The table is rewritten after every
run, so a call cut short by its limit still leaves what finished. On a GPU machine without the app's
Hydra, carry its wheels and the data (``benchmarks/gpu.sh fetch``, then ``benchmarks/gpu.sh table``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = (
    "zhong2020_fashion_mnist_resnet20", "zhong2020_fashion_mnist_resnet20_erasing",
    "zhong2020_fashion_mnist_resnet32", "zhong2020_fashion_mnist_resnet32_erasing",
)  # fmt: skip
WITH = "_erasing"  # a recipe named <baseline>_erasing is compared with <baseline>


def composed(recipe: str) -> dict:
    """The recipe's config as the app composes it (its epochs, schedule and paper figure)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mixhook.app import CONF_DIR
    from mixhook.app.hydra_compat import VERSION_BASE

    with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
        cfg = compose(config_name="config", overrides=[f"experiment={recipe}"])
    return OmegaConf.to_container(cfg, resolve=True)


def shortened(cfg: dict, epochs: int | None) -> list[str]:
    """The overrides that run ``cfg`` for ``epochs`` epochs (``None``: as written), its step schedule's
    milestones scaled to them (each at least one epoch after the last, none past the run)."""
    if epochs is None:
        return []
    total = cfg["trainer"]["epochs"]
    overrides = [f"trainer.epochs={epochs}"]
    milestones = cfg.get("scheduler", {}).get("milestones")
    if milestones:
        scaled = []
        for m in milestones:
            at = max(round(m * epochs / total), scaled[-1] + 1 if scaled else 1)
            if at < epochs:
                scaled.append(at)
        overrides.append(f"scheduler.milestones=[{','.join(map(str, scaled))}]")
    return overrides


def command(recipe: str, seed: int, extra: list[str], run_dir: Path, args, threads: int) -> list[str]:
    root = [f"data.root={Path(args.data_root).resolve()}"] if args.data_root else []
    return [
        sys.executable, str(ROOT / "train.py"), f"experiment={recipe}", f"seed={seed}", *extra, *root,
        f"trainer.device={args.device}", f"trainer.threads={threads}", "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def summaries(runs: Path, wanted: set[tuple[str, int]]) -> dict[str, dict[int, dict]]:
    """The summaries of this call's finished runs (``wanted``: its recipes and seeds), by recipe and seed."""
    found: dict[str, dict[int, dict]] = {}
    for recipe, seed in sorted(wanted):
        path = runs / recipe / str(seed) / "summary.json"
        if path.exists():
            found.setdefault(recipe, {})[seed] = json.loads(path.read_text())
    return found


def _error(summary: dict, best: bool = False) -> float:
    return 100.0 * (1.0 - summary["best_test_acc" if best else "test_acc"])


def _pm(values: list[float], signed: bool = False) -> str:
    if not values:
        return "—"
    mean = statistics.fmean(values)
    return f"{mean:{'+' if signed else ''}.2f}" + (
        f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    )


def table(found: dict, recipes: list[str], meta: dict) -> tuple[str, dict]:
    """The Markdown table and its data: each recipe's runs against the paper's figure, and each Random
    Erasing recipe's paired difference from its baseline."""
    rows, data = [], {"meta": meta, "recipes": {}, "pairs": {}}
    for recipe in recipes:
        runs = found.get(recipe, {})
        last = [_error(s) for s in runs.values()]
        best = [_error(s, True) for s in runs.values()]
        paper = next((s.get("paper") for s in runs.values() if s.get("paper")), None) or {}
        epochs = sorted({s["epochs"] for s in runs.values()})
        data["recipes"][recipe] = {
            "seeds": sorted(runs), "test_error": last, "best_test_error": best, "paper": paper.get("value"),
            "epochs": epochs,
        }  # fmt: skip
        rows.append(
            f"| `{recipe}` | {len(runs)} | {', '.join(map(str, epochs)) or '—'} | {_pm(last)} | "
            f"{_pm(best)} | {paper.get('value', '—')} |"
        )
    pairs = []
    for recipe in recipes:
        base = recipe.removesuffix(WITH)
        if recipe == base or base not in found or recipe not in found:
            continue
        seeds = sorted(set(found[base]) & set(found[recipe]))
        diffs = [_error(found[recipe][s]) - _error(found[base][s]) for s in seeds]
        paper = [data["recipes"][r]["paper"] for r in (base, recipe)]
        published = f"{paper[1] - paper[0]:+.2f}" if None not in paper else "—"
        data["pairs"][recipe] = {"baseline": base, "seeds": seeds, "difference": diffs, "paper": published}
        pairs.append(f"| `{recipe}` − `{base}` | {len(seeds)} | {_pm(diffs, signed=True)} | {published} |")
    lines = [
        f"# A paper's table on {meta['device']}", "",
        f"`python benchmarks/paper_table.py` on {meta['date']} ({meta['device']}, torch {meta['torch']}): "
        f"each recipe as its experiment config writes it, {meta['schedule']}; {meta['jobs']} runs at a time, "
        f"{meta['seconds']:.0f} s in all. Test error %, mean ± std over the seeds; *best*: each run's lowest "
        "over its epochs (the Random Erasing script keeps the best, and its README does not say which it "
        "reports).", "",
        "| recipe | runs | epochs | test error, last epoch | best epoch | paper |",
        "| --- | --- | --- | --- | --- | --- |", *rows,
    ]  # fmt: skip
    if pairs:
        lines += [
            "", "With Random Erasing against without it, seed by seed (points of test error; the paper's is "
            "the difference of its two figures):", "",
            "| pair | seeds | difference | paper |", "| --- | --- | --- | --- |", *pairs,
        ]  # fmt: skip
    return "\n".join(lines) + "\n", data


class Runs:
    """The (recipe, seed) runs of one call: started ``jobs`` at a time until the budget is spent, each one's
    end noted, the table rewritten after each."""

    def __init__(self, args, recipes: list[str], seeds: list[int], configs: dict, device):
        import torch

        from benchmarks.report import device_name, device_slug

        self.args, self.recipes, self.configs = args, recipes, configs
        self.dir = Path(args.runs) if args.runs else Path(args.out) / "paper-table"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.threads = max((os.cpu_count() or 1) // args.jobs, 1)
        day = datetime.date.today().isoformat()
        self.stem = Path(args.out) / f"{device_slug(device)}-{day}-paper-table"
        schedule = (
            "as written" if args.epochs is None else f"shortened to {args.epochs} epochs (milestones scaled)"
        )
        self.meta = {
            "device": device_name(device), "date": day, "torch": torch.__version__, "jobs": args.jobs,
            "schedule": schedule,
        }  # fmt: skip
        self.queue = [(r, s) for s in seeds for r in recipes]
        self.wanted = set(self.queue)
        self.running: list[tuple] = []  # (process, its log file, recipe, seed)
        self.failed: list[str] = []
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def start(self) -> None:
        """Start runs while fewer than ``jobs`` run and the budget lasts."""
        while self.queue and len(self.running) < self.args.jobs and self.elapsed() < self.args.budget:
            recipe, seed = self.queue.pop(0)
            shutil.rmtree(self.dir / recipe / str(seed), ignore_errors=True)  # (an earlier call's run of it)
            log = open(self.dir / f"{recipe}-{seed}.log", "w")  # noqa: SIM115  (closed when the run ends)
            extra = shortened(self.configs[recipe], self.args.epochs)
            line = command(recipe, seed, extra, self.dir / recipe / str(seed), self.args, self.threads)
            process = subprocess.Popen(line, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            self.running.append((process, log, recipe, seed))
            print(f"[{self.elapsed():.0f}s] started {recipe} seed {seed}", flush=True)

    def reap(self) -> None:
        """Note the runs that ended (a failed one's last line), and rewrite the table."""
        for entry in list(self.running):
            process, log, recipe, seed = entry
            if process.poll() is None:
                continue
            self.running.remove(entry)
            log.close()
            if process.returncode:
                last = (self.dir / f"{recipe}-{seed}.log").read_text().strip().splitlines() or ["(no output)"]
                self.failed.append(f"{recipe} seed {seed}: {last[-1]}")
            print(f"[{self.elapsed():.0f}s] {recipe} seed {seed}: exit {process.returncode}", flush=True)
            self.write()

    def write(self) -> None:
        meta = {**self.meta, "seconds": self.elapsed(), "failed": self.failed}
        meta["not_started"] = [f"{r} seed {s}" for r, s in self.queue]
        text, data = table(summaries(self.dir, self.wanted), self.recipes, meta)
        text += "".join(f"\n- failed: {f}" for f in self.failed)
        text += "".join(f"\n- not started (the budget was spent): {r} seed {s}" for r, s in self.queue)
        self.stem.with_suffix(".md").write_text(text)
        self.stem.with_suffix(".json").write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/paper_table.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--recipes", default=",".join(RECIPES), help="experiment configs, comma-separated")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=None, help="shorten every recipe to this many epochs")
    parser.add_argument("--jobs", type=int, default=8, help="runs at a time")
    parser.add_argument("--data-root", default=None, help="the data's folder (data.root)")
    parser.add_argument("--device", default="cuda", help="trainer.device")
    parser.add_argument(
        "--budget", type=float, default=float("inf"), help="seconds after which no run starts"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where results go")
    parser.add_argument(
        "--runs", default=None, help="the run directories' folder (default: <out>/paper-table)"
    )
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.jobs < 1 or (args.epochs is not None and args.epochs < 1):
        parser.error("--jobs and --epochs must be at least 1")
    import torch

    try:
        configs = {r: composed(r) for r in recipes}
    except Exception as err:  # noqa: BLE001  (an unknown recipe: Hydra's own words, in one line)
        parser.error(f"--recipes: {str(err).splitlines()[0]}")
    runs = Runs(args, recipes, seeds, configs, torch.device(args.device))
    runs.start()
    while runs.running:
        time.sleep(1)
        runs.reap()
        runs.start()
    runs.write()
    from mixhook.app.report import write_report

    if any(runs.dir.glob("*/*/.hydra/overrides.yaml")):
        write_report(runs.dir)  # (every run under the folder, this call's and any earlier one's)
    print(runs.stem.with_suffix(".md").read_text())
    return 1 if runs.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
