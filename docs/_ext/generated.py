"""The pages the documentation build writes before it reads the sources (``docs/_generated/``, not in git).

The Performance page's tables come from the benchmark's own results (``benchmarks/results/<stem>.json`` and
the ``<stem>.md`` the benchmark wrote beside it), so they cannot be copied by hand or drift from a run:

- ``_generated/goals.md``: every goal of every whole-suite run (``<device>-<date>.json``), side by side;
- ``_generated/runs.md``: one row per results file (device, date, command, goals met and missed);
- ``_generated/results/<stem>.md``: each results file's own Markdown, under its file name;
- ``_generated/costs.md``: the catalogue's cost of every method (the latest ``*-methods`` run; the methods
  that need a ViT, the latest run of the ``vit`` case) and of the scaling hooks (the latest whole-suite CPU
  run);
- ``_generated/methods-table.md``, ``_generated/methods.md``, ``_generated/api-methods.md``: the catalogue's
  table of the methods, their sections and the API page's list, read from each method's card
  (``mixhook.Card``; its ``mixup=`` configs from the app's group), so a new method's module is all it takes;
The catalogue's pictures (``docs/gallery/``, drawn by ``docs/gallery.py``) are checked here: a method without
its picture or its section in ``catalogue.md``, or a picture of no method, is a build error naming it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS.parent / "benchmarks" / "results"
WHOLE_SUITE = re.compile(r"^(cpu|cuda-[a-z0-9]+)-\d{4}-\d{2}-\d{2}$")  # a run of every case


def result_files(results: Path = RESULTS) -> list[Path]:
    """The committed results (a quick run's ``*-quick.*`` files are the test suite's, not results)."""
    return sorted(p for p in results.glob("*.json") if not p.stem.endswith("-quick"))


def _link(stem: str) -> str:
    """A link to the generated page of the results file ``stem``."""
    return f"[{stem}](/_generated/results/{stem}.md)"


def _measured(goal: dict) -> str:
    value = goal["measured"]
    text = str(value) if isinstance(value, int) else f"{value:.3f}"
    if goal["met"]:
        return text
    return f"**{text} (not resolved)**" if goal.get("verdict") == "not resolved" else f"**{text} (missed)**"


def goals_table(results: dict[str, dict]) -> str:
    """Every goal of every whole-suite run: one row per goal and place, one column per run."""
    runs = [(stem, run) for stem, run in results.items() if WHOLE_SUITE.match(stem)]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    limits: dict[tuple[str, str], object] = {}
    for stem, run in runs:
        for goal in run.get("goals", []):
            key = (goal["goal"], goal["where"])
            rows.setdefault(key, {})[stem] = _measured(goal)
            limits[key] = goal["limit"]
    head = "| goal | where | limit | " + " | ".join(_link(stem) for stem, _ in runs) + " |"
    lines = [head, "| " + " | ".join(["---"] * (3 + len(runs))) + " |"]
    for (goal, where), measured in rows.items():
        cells = " | ".join(measured.get(stem, "") for stem, _ in runs)
        lines.append(f"| `{goal}` | {where} | {limits[(goal, where)]} | {cells} |")
    return "\n".join(lines) + "\n"


def runs_table(results: dict[str, dict]) -> str:
    """One row per results file: its device, date, command and goals."""
    lines = [
        "| results | device | date | command | goals met | missed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for stem, run in results.items():
        meta = run.get("meta", {})
        goals = run.get("goals", [])
        counts: dict[str, int] = {}
        for goal in goals:
            if not goal["met"]:
                counts[goal["goal"]] = counts.get(goal["goal"], 0) + 1
        missed = ", ".join(f"`{g}`" + (f" ×{n}" if n > 1 else "") for g, n in counts.items())
        # (where the run wrote its files is the author's machine's: the row's link is where they are now)
        command = re.sub(r" --out \S+", "", meta.get("command", ""))
        lines.append(
            f"| {_link(stem)} | {meta.get('device', '')} | {meta.get('date', '')} "
            f"| `{command}` | {sum(g['met'] for g in goals)} of {len(goals)} | {missed} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(ratio: dict) -> str:
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}..{ratio['max']:.2f})"


def gpu_costs(results: dict[str, dict]) -> dict[str, tuple[dict, str]]:
    """Each method's step over Manifold Mixup's on a GPU, from the latest GPU run (by its date) that
    measured it, with that run's stem."""
    runs = [s for s in results if s.startswith("cuda-") and "methods" in results[s]]
    found: dict[str, tuple[dict, str]] = {}
    for stem in sorted(runs, key=lambda s: re.search(r"\d{4}-\d{2}-\d{2}", s).group()):
        for name, ratio in results[stem]["methods"].get("vs_manifold", {}).items():
            found[name] = (ratio, stem)
    return found


def vit_costs(results: dict[str, dict], shown: set[str]) -> list[str]:
    """The cost rows of the methods that need a ViT (those not in ``shown``): their step over a plain one
    in the latest CPU run of the ``vit`` case, on timm's ViT-Tiny."""
    vits = [s for s in results if s.startswith("cpu-") and "vit" in results[s]]
    if not vits:
        return []
    stem = max(vits, key=lambda s: re.search(r"\d{4}-\d{2}-\d{2}", s).group())
    run = results[stem]["vit"]
    where = f"{run['model']}, batch {run['batch']} (beside CutMix: its file)"
    return [
        f"| `{name}` | {_fmt(ratio)} | | | {_link(stem)}: {where} |"
        for name, ratio in run["vs_none"].items()
        if name not in shown
    ]


def costs_table(results: dict[str, dict]) -> str:
    """Each method's training step over a plain one and over Manifold Mixup's (the latest methods run, and
    the methods only a subset run measured), the latter on a GPU too (the latest GPU run that measured
    it), and the scaling hooks' over a plain step (the latest whole-suite CPU run)."""
    methods = [s for s in results if s.endswith("-methods") and s.startswith("cpu-")]
    suites = [s for s in results if WHOLE_SUITE.match(s) and s.startswith("cpu-")]
    gpu = gpu_costs(results)
    lines = [
        "| hook | step / plain step | step / Manifold Mixup step | on a GPU: / Manifold Mixup | results |",
        "| --- | --- | --- | --- | --- |",
    ]
    # the latest whole methods run, then the methods a later subset run measured (--methods ... --suffix
    # methods-<what>) that it does not list
    extra = [s for s in results if "-methods-" in s and s.startswith("cpu-") and "methods" in results[s]]
    rows: dict[str, str] = {}  # method -> the run its row reads (a CPU run's, else a GPU run's alone)
    for stem in [*methods[-1:], *extra]:
        for name in results[stem]["methods"]["vs_none"]:
            rows.setdefault(name, stem)
    for name, (_, stem) in gpu.items():
        rows.setdefault(name, stem)
    for name, stem in rows.items():
        run, link, on_cpu = results[stem]["methods"], _link(stem), stem.startswith("cpu-")
        label = name.replace("_gradient", " (gradient saliency)").replace(
            "_layer1_activation", " (saliency of layer1)"
        )
        layer = run["layer"]
        if name.endswith("_input"):  # a variant measured at the model's input (PuzzleMix_input)
            label, layer = f"{name.removesuffix('_input')} (at the input)", "input"
        where = f"{run['model']} at `{layer}`, batch {run['batch']}"
        on_gpu = ""
        if name in gpu:
            device = results[gpu[name][1]].get("meta", {}).get("device", "GPU").removeprefix("NVIDIA ")
            on_gpu = f"{_fmt(gpu[name][0])}, [{device}](/_generated/results/{gpu[name][1]}.md)"
        ratio = _fmt(run["vs_none"][name]) if on_cpu else ""
        versus = run.get("vs_manifold", {}).get(name) if on_cpu else None
        versus = _fmt(versus) if versus else ""
        lines.append(f"| `{label}` | {ratio} | {versus} | {on_gpu} | {link}: {where} |")
    lines += vit_costs(results, set(rows))
    if suites:
        steps, link = results[suites[-1]]["training_step"][0], _link(suites[-1])
        for name, key in (("InputScale", "inputscale_layer2"), ("GradScale", "gradscale_layer3")):
            if key in steps["vs_none"]:
                where = f"{steps['model']} at `{key.rsplit('_', 1)[1]}`, batch {steps['batch']}"
                lines.append(f"| `{name}` | {_fmt(steps['vs_none'][key])} | | | {link}: {where} |")
    return "\n".join(lines) + "\n"


def gallery_problems(gallery: Path, methods: list[str], skipped: dict[str, str]) -> list[str]:
    """A method without its picture (its card says the gallery draws it), a picture of no method."""
    pictures = {p.stem for p in gallery.glob("*.png")}
    problems = [
        f"{gallery}/{name}.png: no picture of {name}: run python docs/gallery.py"
        for name in methods
        if name not in pictures and name not in skipped
    ]
    problems += [
        f"{gallery}/{stem}.png: a picture of no method (docs/gallery.py draws one per mixer)"
        for stem in sorted(pictures - set(methods))
    ]
    return problems


def method_table() -> str:
    """The catalogue's table: one row per method (its card), in the catalogue's order."""
    from mixhook.app.methods import configs_of
    from mixhook.engine.card import METHODS, catalogue_order

    configs = configs_of()
    lines = [
        "| method | paper | mixes | where | `mixup=` | workflows |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in catalogue_order():
        card = METHODS[name].card
        where = ", ".join(f"`{c}`" for c in configs[name])
        if card.app:  # (the overrides are long names: its section below shows the command)
            where += f" ([with overrides](#{name.lower()}))"
        lines.append(
            f"| [`{name}`](#{name.lower()}) | {card.paper} | {card.mixes} | {card.where} | {where} "
            f"| {card.workflows} |"
        )
    return "\n".join(lines) + "\n"


def method_sections() -> str:
    """Each method's section of the catalogue (its card): signature, hook, paper and commands, what it
    computes, its picture."""
    from mixhook.app.methods import configs_of
    from mixhook.engine.card import METHODS, catalogue_order

    configs = configs_of()
    parts = []
    for name in catalogue_order():
        card = METHODS[name].card
        run = ""
        if card.app:  # the default experiment cannot take it: the command with the overrides it needs
            run = f" The app trains it with `python train.py mixup={configs[name][0]} {' '.join(card.app)}`."
        picture = (
            f"![{name}](/gallery/{name}.png)" if card.picture is True else f"No picture: {card.picture}."
        )
        parts.append(
            f"### {name}\n\n`{card.signature}`: {card.hook}. {card.paper}; {card.commands}.{run}\n\n"
            f"{card.details}\n\n{picture}\n"
        )
    return "\n".join(parts)


def api_methods() -> str:
    """The API page's list of the methods, in the catalogue's order."""
    import mixhook
    from mixhook.app.methods import target
    from mixhook.engine.card import METHODS, catalogue_order

    del mixhook
    classes = "".join(  # (the card is the catalogue's: its section shows it)
        f".. autoclass:: {target(METHODS[n])}\n   :exclude-members: card\n" for n in catalogue_order()
    )
    return f"```{{eval-rst}}\n{classes}```\n"


def hooks_table() -> str:
    """The catalogue's table of the hooks that are not mixers, from their cards."""
    from mixhook.engine.card import hook_table

    # (a card links a docs page by its path from the docs' root: made absolute, as this page is included)
    return re.sub(r"\]\((?!https?:|#|/)", "](/", hook_table())


def api_hooks() -> str:
    """The API page's list of the hooks that are not mixers (their cards), in the catalogue's order."""
    import mixhook
    from mixhook.engine.card import HOOKS, hook_order

    del mixhook
    classes = "".join(
        f".. autoclass:: mixhook.{n}\n   :exclude-members: card\n"
        + (f"   :members: {HOOKS[n].card.members}\n" if HOOKS[n].card.members else "")
        for n in hook_order()
    )
    return f"```{{eval-rst}}\n{classes}```\n"


def result_page(path: Path) -> str:
    """A page holding the results file's own Markdown (written by the benchmark run), under its name."""
    markdown = path.with_suffix(".md")
    include = f"```{{include}} ../../../benchmarks/results/{markdown.name}\n:heading-offset: 1\n```\n"
    return f"# {path.stem}\n\n{include}"


def write(out: Path = DOCS / "_generated") -> tuple[list[Path], list[str]]:
    """Write every generated page under ``out``; returns their paths and the problems found. A page whose
    text is unchanged is not rewritten (Sphinx would rebuild it)."""
    if str(DOCS) not in sys.path:
        sys.path.insert(0, str(DOCS))
    from gallery import NOT_DRAWN

    from mixhook.mixers import METHODS

    files = result_files()
    problems = gallery_problems(Path(out).parent / "gallery", sorted(METHODS), NOT_DRAWN)
    problems += [
        f"{p}: has no {p.with_suffix('.md').name} beside it (the benchmark writes both)"
        for p in files
        if not p.with_suffix(".md").exists()
    ]
    files = [p for p in files if p.with_suffix(".md").exists()]
    results = {p.stem: json.loads(p.read_text()) for p in files}  # sorted by name: by date within a kind
    pages = {
        out / "goals.md": goals_table(results),
        out / "runs.md": runs_table(results),
        out / "costs.md": costs_table(results),
        out / "methods-table.md": method_table(),
        out / "methods.md": method_sections(),
        out / "api-methods.md": api_methods(),
        out / "hooks-table.md": hooks_table(),
        out / "api-hooks.md": api_hooks(),
    }
    pages.update({out / "results" / f"{p.stem}.md": result_page(p) for p in files})
    toc = "\n".join(f"results/{p.stem}" for p in files)
    pages[out / "results.md"] = (
        "# Results files\n\nEvery file under `benchmarks/results/`, as the benchmark wrote it.\n\n"
        f"```{{include}} runs.md\n```\n\n```{{toctree}}\n:hidden:\n\n{toc}\n```\n"
    )
    for stale in (out / "results").glob("*.md"):  # the page of a results file that is gone
        if stale not in pages:
            stale.unlink()
    for page, text in pages.items():
        page.parent.mkdir(parents=True, exist_ok=True)
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
    return list(pages), problems


def _on_builder_inited(app) -> None:
    _, problems = write(Path(app.srcdir) / "_generated")
    for problem in problems:
        logger.warning(problem, type="mixhook", subtype="gallery")


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
