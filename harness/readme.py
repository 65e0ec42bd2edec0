"""What the README shows, read and compared with what a run printed and wrote: the checks the README's own
run (``python -m tools.readme_run``, a step of ``.ci/run``) and the suite's short run of the same command
(tests/e2e/test_app.py) share, and the blocks the packaging and docs tests read."""

import csv
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quoted_block(after: str, page: str = "README.md", language: str = "") -> list[str]:
    """The lines of the first ``` block (a ```language one, where given) that follows the text ``after`` in
    the README (or a docs page); none where there is no such block."""
    text = (ROOT / page).read_text()
    fence = re.escape(language) if language else r"\w*"
    found = re.search(rf"```{fence}\n(.*?)\n```", text[text.index(after) :], re.S)
    return found.group(1).splitlines() if found else []


def shape(line: str) -> str:
    """A log line without its time stamp, run directory and numbers."""
    line = re.sub(r"^\[[^\]]*\]", "[...]", line)
    return re.sub(r"-> \S+", "-> DIR", re.sub(r"\d+(\.\d+)?", "N", line))


def problems(out: Path, log: str, fonts: Path) -> list[str]:
    """What differs between the README and a run that wrote ``out`` and printed ``log`` with matplotlib's
    cache in ``fonts``: one line each, none when they agree."""
    found = []
    printed = [shape(line) for line in log.splitlines() if "[mixhook]" in line]
    quoted = quoted_block("It prints one line per epoch")
    if quoted[2] != "..." or len(printed) != 17:  # the start, 15 epochs, done
        found.append(
            f"printed {len(printed)} [mixhook] lines, the README shows the start, 15 epochs and done"
        )
    elif [shape(line) for line in quoted[:2] + quoted[3:]] != printed[:2] + printed[-2:]:
        found.append(f"printed {printed[:2] + printed[-2:]}, the README shows {quoted[:2] + quoted[3:]}")
    others = [line for line in log.splitlines() if line.strip() and "[mixhook]" not in line]
    if others:  # (not matplotlib's "generated new fontManager" from building its font cache)
        found.append(f"printed lines that are not the app's: {others[:3]}")
    if not list(fonts.glob("fontlist-*.json")):
        found.append("matplotlib built no font cache: the run was not as on a fresh machine")
    for name in (
        "metrics.csv",
        "summary.json",
        "reliability.png",
        "last.pt",
        "train.log",
        ".hydra/config.yaml",
    ):
        if not (out / name).exists():
            found.append(f"the run wrote no {name}, which the README lists")
    if found:
        return found
    summary = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    if [r["epoch"] for r in rows] != [str(e) for e in range(1, 16)] or summary["epochs"] != 15:
        found.append(f"metrics.csv has epochs {[r['epoch'] for r in rows]}, not 1..15")
    if summary["mixup"]["layer"] != ["input", "layer1", "layer2"] or summary["mixup"]["alpha"] != 2.0:
        found.append(f"the default mixup is {summary['mixup']}, not the paper's")
    if not (0.985 <= summary["test_acc"] <= 0.9972 and 0.05 <= summary["test_ece"] <= 0.11):
        found.append(
            f"test_acc {summary['test_acc']}, test_ece {summary['test_ece']}: outside the README's range"
        )
    final = printed[-1]
    if not final.startswith("[...][mixhook][INFO] - done: test_acc N%"):
        found.append(f"the final line is {final!r}")
    return found
