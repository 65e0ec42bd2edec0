"""Run the zoo and write its report: ``python -m tools.zoo`` (``--help`` for the options).

The report counts the outcomes by family and by model, lists every wrong result and every error (there
should be none), and groups the refusals and skips by their message (quoted names and numbers left out),
each with an example, so that every kind of refusal can be read and judged: is it what a user would
expect?
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from datetime import date
from pathlib import Path

import torch

from harness.zoo.catalogue import ZOO
from harness.zoo.oracles import Case, run_model

OUTCOMES = ("exact", "refused", "wrong", "error", "skipped")
ROOT = Path(__file__).resolve().parents[1]


def group_of(message: str) -> str:
    """A refusal's message with what varies from case to case (quoted names, shapes, numbers) left out."""
    message = re.sub(r"'[^']*'", "'…'", message)
    message = re.sub(r"\([0-9, ?BCHWLDT]+\)", "(…)", message)
    message = re.sub(r"\b\d+\b", "N", message)
    return message


def versions() -> str:
    import timm
    import torchvision
    import transformers

    python = platform.python_version()
    return (
        f"Python {python}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"timm {timm.__version__}, transformers {transformers.__version__}"
    )


def esc(text) -> str:
    """Text with what Markdown would read as markup escaped (messages hold ``*``, ``|``, ``_``, ``<``)."""
    return re.sub(r"([*|<>_\\[\]])", r"\\\1", str(text))


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


ORACLE_WORDS = {
    None: "the hand edit, lam 0 and 1 against the unhooked model, padding on the unmixed sequence",
    "manifold": "Manifold Mixup's hand edit, lam 0 and 1 against the unhooked model",
    "cutmix": "CutMix's box pasted by hand",
    "padding": "padding on the unmixed sequence",
    "automix": "AutoMix's hand edit with the mask its Mix Block made",
}


def markdown(cases: list[Case], seconds: float, command: str, methods: list[str] | None = None) -> str:
    """The report of ``cases`` as a Markdown page (of the oracles ``methods`` where given)."""
    models = sorted({c.model for c in cases})
    by_family: dict[str, Counter] = defaultdict(Counter)
    by_model: dict[str, Counter] = defaultdict(Counter)
    for c in cases:
        by_family[c.family][c.outcome] += 1
        by_model[c.model][c.outcome] += 1
    total = Counter(c.outcome for c in cases)
    families = sorted(by_family)
    counts = ", ".join(f"{sum(1 for m in models if m.startswith(f))} {f}" for f in families)
    lines = [
        "# The model zoo" + (f": {', '.join(methods)}" if methods else ""),
        "",
        f"mixhook at sampled layers of {len(models)} models ({counts}),"
        " built small from their configs in float64, each case judged by an oracle mixhook does not compute "
        f"({', '.join(ORACLE_WORDS[m] for m in methods) if methods else ORACLE_WORDS[None]}, eval mode):"
        " see `harness/zoo/oracles.py`. **wrong** is a silent wrong result and **error** an exception that "
        "is not mixhook's one-line refusal: there must be none.",
        "",
        f"Made {date.today().isoformat()} by `{command}` in {seconds / 60:.1f} minutes; {versions()}.",
        "",
        "## Outcomes",
        "",
    ]
    rows = [[f, *(by_family[f][o] for o in OUTCOMES), sum(by_family[f].values())] for f in families]
    rows.append(["**all**", *(f"**{total[o]}**" for o in OUTCOMES), f"**{len(cases)}**"])
    lines += _table(["family", *OUTCOMES, "cases"], rows)
    for title, outcome in (("Wrong results", "wrong"), ("Errors", "error")):
        found = [c for c in cases if c.outcome == outcome]
        lines += ["", f"## {title}", ""]
        if not found:
            lines.append("None.")
            continue
        rows = [[esc(c.model), f"`{c.layer}`", c.method, esc(c.detail)] for c in found]
        lines += _table(["model", "layer", "method", "what"], rows)
    for title, outcome in (("Refusals, by message", "refused"), ("Skipped, by reason", "skipped")):
        groups: dict[str, list[Case]] = defaultdict(list)
        for c in cases:
            if c.outcome == outcome:
                groups[group_of(c.detail)].append(c)
        lines += ["", f"## {title}", ""]
        if not groups:
            lines.append("None.")
            continue
        rows = []
        for _, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            first = group[0]
            where = sorted({esc(c.model.split("/", 1)[1]) for c in group})
            shown = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
            rows.append(
                [
                    len(group),
                    shown,
                    f"{esc(first.model)} `{first.layer}` ({first.method}): {esc(first.detail)}",
                ]
            )
        lines += _table(["cases", "models", "example"], rows)
    lines += ["", "## By model", ""]
    rows = [[esc(m), *(by_model[m][o] or "" for o in OUTCOMES)] for m in models]
    lines += _table(["model", *OUTCOMES], rows)
    return "\n".join(lines).replace("|  |", "| |") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.zoo", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["*"], help="name patterns (default: every model)")
    parser.add_argument("--layers", type=int, default=9, help="layers sampled per model (default 9)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "zoo.md"), help="the Markdown report")
    parser.add_argument("--json", default=None, help="also write every case as JSON here")
    parser.add_argument(
        "--methods", nargs="*", default=None,
        help="the oracles to run (manifold, cutmix, padding, automix; default: those of each model's kind)",
    )  # fmt: skip
    parser.add_argument(
        "--portable", action="store_true",
        help="check stage:k, block:k and depth:f on each model instead (report: docs/zoo-portable.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    entries = [m for m in ZOO if any(fnmatch.fnmatch(m.name, p) for p in args.models)]
    if not entries:
        print(f"no model matches {args.models}; the zoo: {', '.join(m.name for m in ZOO)}", file=sys.stderr)
        return 2
    if args.portable:
        default = str(ROOT / "docs" / "zoo.md")
        return _portable(
            entries, args.models, str(ROOT / "docs" / "zoo-portable.md") if args.out == default else args.out
        )
    start, cases = time.time(), []
    for i, entry in enumerate(entries, 1):
        began = time.time()
        found = run_model(entry, args.layers, methods=args.methods)
        cases += found
        counts = Counter(c.outcome for c in found)
        summary = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
        print(f"[{i}/{len(entries)}] {entry.name}: {summary} ({time.time() - began:.0f} s)", flush=True)
    command = "python -m tools.zoo" + (f" --models {' '.join(args.models)}" if args.models != ["*"] else "")
    command += f" --layers {args.layers}" if args.layers != 9 else ""
    command += f" --methods {' '.join(args.methods)}" if args.methods else ""
    Path(args.out).write_text(markdown(cases, time.time() - start, command, args.methods))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in cases], indent=1))
    bad = sum(c.outcome in ("wrong", "error") for c in cases)
    print(f"{len(cases)} cases, {bad} wrong or errors -> {args.out}")
    return 1 if bad else 0


def _portable(entries, patterns: list[str], out: str) -> int:
    from harness.zoo.portable import check

    start, rows, bad = time.time(), [], 0
    for i, entry in enumerate(entries, 1):
        what, problems = check(entry)
        bad += bool(problems)
        rows.append([esc(entry.name), esc(what), esc("; ".join(problems)) if problems else "ok"])
        print(f"[{i}/{len(entries)}] {entry.name}: {what}: {'; '.join(problems) or 'ok'}", flush=True)
    command = "python -m tools.zoo --portable"
    command += f" --models {' '.join(patterns)}" if patterns != ["*"] else ""
    lines = [
        "# Portable layer specs over the zoo",
        "",
        f"`{command}` ({len(entries)} models, {time.time() - start:.0f} s; {versions()}). For each model: "
        "what it states (its source, stages and blocks), and whether every `stage:k` resolved to the module "
        "whose output has the stage's stated reduction and channels on a real forward, every `block:k` to a "
        "block that runs in the order listed (a timm plain transformer's block tokens against "
        "`forward_intermediates`), `depth:0`/`depth:1` to the first and last block, and Manifold Mixup at "
        "`depth:0.5` to the hand edit at the real name. A model that states nothing is refused in one line.",
        "",
    ]
    lines += _table(["model", "states", "result"], rows)
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"{len(entries)} models, {bad} with problems -> {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # the libraries' own deprecation notices about their configs
    sys.exit(main())
