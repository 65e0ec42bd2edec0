"""The README's own run, exactly: ``python train.py`` as the README shows it, in a fresh directory, as on a
fresh machine (matplotlib without a font cache), checked against the output the README quotes.

``python -m tests.readme_run`` (a step of ``.ci/run``): exit 0 and one line with its time when the run prints
the lines the README shows (the numbers aside: they differ across CPUs and thread counts, the README says by
how much), ends in the README's range, and writes what the README lists; otherwise exit 1 and one line per
difference. The suite checks the same files on a short run (tests/e2e/test_app.py); this is the 15-epoch run
a new user starts with.
"""

import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
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


def command() -> list[str]:
    """The README's command under 'Train', as written."""
    line = "\n".join(quoted_block("## Train\n"))
    if line != "python train.py":
        raise SystemExit(f"README run: the README shows {line!r} to train now; update tests/readme_run.py")
    return [sys.executable, str(ROOT / "train.py")]


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


def main() -> int:
    argv = command()
    with tempfile.TemporaryDirectory() as tmp:
        cwd, fonts = Path(tmp) / "user", Path(tmp) / "matplotlib"
        cwd.mkdir()
        fonts.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MIXHOOK_THREADS")}
        started = time.time()
        result = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, env={**env, "MPLCONFIGDIR": str(fonts)}
        )
        seconds = time.time() - started
        if result.returncode != 0:
            print(f"README run: python train.py exited {result.returncode}:\n{result.stderr[-3000:]}")
            return 1
        (out,) = [p.parent for p in (cwd / "outputs").glob("*/*/summary.json")]
        found = problems(out, result.stdout + result.stderr, fonts)
        if found:
            print("README run: python train.py differs from what the README shows:", *found, sep="\n  ")
            return 1
        summary = json.loads((out / "summary.json").read_text())
    print(
        f"README run: python train.py as the README shows it, test_acc {summary['test_acc']:.2%}"
        f" ({seconds:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
