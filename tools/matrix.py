"""Run the matrix and write its table: ``python -m tools.matrix`` (``--help`` for the options).

The one-process cells run here, one after another; the DDP and FSDP2 cells of every method run in one
torchrun launch of two processes (:mod:`.distributed`). The table (``docs/matrix.md``) has a row per method
and a column per workflow; each refusal's line is kept below it, numbered, and any cell that ``fails``
(there should be none) is listed with its error, and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from harness.matrix.cells import WORKFLOWS, Cell, run
from harness.matrix.language import HOOK_ROWS
from harness.matrix.methods import METHODS

ROWS = [*METHODS, *HOOK_ROWS]  # every mixer and policy, then the hooks with a loss of their own
BY_NAME = {m.name: m for m in ROWS}

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ddp", "fsdp")
COLUMNS = {
    "own": "own loop", "lightning": "Lightning", "hf": "HF Trainer", "trl": "TRL", "timm": "timm",
    "app": "app", "resume": "resume", "ddp": "DDP", "fsdp": "FSDP2",
}  # fmt: skip


def distributed(names: list[str], modes: tuple[str, ...] = MODES) -> list[Cell]:
    """The DDP and FSDP2 cells of ``names`` (or those of ``modes``: harness/matrix/distributed.py), from one
    torchrun launch of two processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cells.json"
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             str(ROOT / "tests" / "matrix" / "distributed.py"), str(out), "--modes=" + ",".join(modes),
             *names],
            cwd=ROOT, capture_output=True, text=True, timeout=1800,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        if result.returncode != 0 or not out.exists():
            tail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
            why = f"torchrun exited {result.returncode}: {tail}"
            return [Cell(n, m, "fails", why) for n in names for m in modes]
        found = json.loads(out.read_text())
    return [Cell(n, m, *found[n][m]) for n in names for m in modes]


def _mark(cell: Cell, notes: dict[str, int]) -> str:
    if cell.outcome in ("refused", "fails", "n/a") and cell.detail:
        number = notes.setdefault(cell.detail, len(notes) + 1)
        return f"{cell.outcome} ({number})"
    return cell.outcome


def markdown(cells: list[Cell], seconds: float) -> str:
    by = {(c.method, c.workflow): c for c in cells}
    columns = [w for w in (*WORKFLOWS, *MODES) if any(c.workflow == w for c in cells)]
    notes: dict[str, int] = {}
    lines = [
        "# The matrix: every method wherever users train",
        "",
        f"Written by `python -m tools.matrix` on {date.today().isoformat()} ({seconds / 60:.0f} minutes on "
        f"{os.cpu_count()} CPU cores; Python {platform.python_version()}, torch {torch.__version__}). Each "
        "method (one representative configuration of every mixer and policy, `harness/matrix/methods.py`) "
        "trains two steps of eight samples in each workflow; a cell is **exact** when the weights equal, "
        "in float64 (to 1e-12), the hand-written loop's on the same draws (the draws reseeded from "
        "`(seed, rank, step)`, the labels handed over before the forward, a class-balanced partner batch "
        "from `PartnerStream`, Remix's counts from the training set, the per-sample loss's mean under the "
        "mix, SGD); **refused** when it stops before its first step with one line (below, numbered); "
        "**trains** for the app's shipped `mixup=` config on the default data (after the one-line refusal "
        "where the default data or model cannot take the method, with the overrides it names); **n/a** "
        "where the workflow is not for the method's model. *TRL*: TRL's `SFTTrainer` (the methods shown on a "
        "language model); *timm*: timm's training step with `MixupFn`; *DDP* and *FSDP2* run the own loop "
        "on two processes (gloo, CPU), each rank on its half of the batch with its own draws, against one "
        "process replaying both ranks' batches (a mixer that counts its training forwards, AdAutoMix, "
        "counting each rank's own); *resume* kills the app's `train.py` (SIGKILL) after a random number "
        "(1 to 8) of its checkpoints and resumes it with `trainer.resume=auto`: exact when its metrics and "
        "summary equal an uninterrupted run's. The last rows are the hooks with a loss of their own "
        "(`hook.loss(model, inputs)`, each from its card's example, `harness/matrix/language.py`) on a tiny "
        "Llama: padded prompt-and-response rows, two micro-batches of four a step (gradient accumulation), "
        "SFTMix's half confident and half unconfident from `PairedSampler` and its loss over the step's "
        "tokens on every process (as its Trainer mixin's); *HF Trainer* and *TRL* make the trainer's class "
        "of the Trainer mixins the card names, the hook in a `HookCallback`.",
        "",
        "| method | " + " | ".join(COLUMNS[c] for c in columns) + " |",
        "| --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for method in dict.fromkeys(c.method for c in cells):
        row = [_mark(by[method, w], notes) if (method, w) in by else "" for w in columns]
        lines.append(f"| `{method}` | " + " | ".join(row) + " |")
    counts = {o: sum(c.outcome == o for c in cells) for o in ("exact", "trains", "refused", "n/a", "fails")}
    lines += ["", "**" + ", ".join(f"{n} {o}" for o, n in counts.items()) + "** cells.", ""]
    if notes:
        lines += ["## Why", ""]
        lines += [f"{n}. {text.replace('|', '/')}" for text, n in notes.items()]
        lines.append("")
    lines += [
        "The suite runs a sample of it (`tests/e2e/test_matrix.py`): every method in the own loop, each "
        "workflow with methods that need what it must give (labels before the forward, a clean batch, a "
        "partner batch, class counts), and both distributed modes in one launch. Language-model methods "
        "are on the [Language models](language-models.md) page; the model zoo ([zoo](zoo.md)) checks the "
        "methods on real architectures.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.matrix",
        description="Run every method in every workflow, judge each cell, write the table (docs/matrix.md).",
    )
    parser.add_argument("--methods", nargs="*", default=None, help="method names (default: all)")
    parser.add_argument("--workflows", nargs="*", default=[*WORKFLOWS, "distributed"], help="workflows")
    parser.add_argument("--out", default=None, help="the table's path (default: docs/matrix.md, whole runs)")
    args = parser.parse_args(argv)
    partial = bool(args.methods) or set(args.workflows) != {*WORKFLOWS, "distributed"}
    table = args.out or (None if partial else str(ROOT / "docs" / "matrix.md"))
    if table is None:  # (a partial table over the whole one would drop every other row)
        print("a partial run: docs/matrix.md is kept and the cells printed; pass --out to write their table")
    methods = [BY_NAME[n] for n in args.methods] if args.methods else ROWS
    started, cells = time.time(), []
    for method in methods:
        for workflow in (w for w in WORKFLOWS if w in args.workflows):
            cell = run(method, workflow)
            print(cell.line()[:200], flush=True)
            cells.append(cell)
    if "distributed" in args.workflows:
        for cell in distributed([m.name for m in methods]):
            print(cell.line()[:200], flush=True)
            cells.append(cell)
    if table is not None:
        Path(table).write_text(markdown(cells, time.time() - started))
        print(f"wrote {table}")
    failed = [c for c in cells if c.outcome == "fails"]
    for cell in failed:
        print(f"FAILS: {cell.line()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # the libraries' own deprecation notices
    sys.exit(main())
