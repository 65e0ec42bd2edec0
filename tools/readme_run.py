"""The README's own run, exactly: ``python train.py`` as the README shows it, in a fresh directory, as on a
fresh machine (matplotlib without a font cache), checked against the output the README quotes.

``python -m tools.readme_run`` (a step of ``.ci/run``): exit 0 and one line with its time when the run prints
the lines the README shows (the numbers aside: they differ across CPUs and thread counts, the README says by
how much), ends in the README's range, and writes what the README lists; otherwise exit 1 and one line per
difference. The suite checks the same files on a short run (tests/e2e/test_app.py); this is the 15-epoch run
a new user starts with.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.readme import problems, quoted_block

ROOT = Path(__file__).resolve().parents[1]


def command() -> list[str]:
    """The README's command under 'Train', as written."""
    line = "\n".join(quoted_block("## Train\n"))
    if line != "python train.py":
        raise SystemExit(f"README run: the README shows {line!r} to train now; update tools/readme_run.py")
    return [sys.executable, str(ROOT / "train.py")]


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
