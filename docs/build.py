"""Build the documentation site with Sphinx, every warning an error.

    python docs/build.py                 # -> docs/_build/html/index.html
    python docs/build.py --out DIR       # elsewhere (the test suite builds into a temporary directory)
    python docs/build.py --source DIR    # another source tree with this conf.py (the suite's bad-input test)

Exit 0 and one line naming the site's index, or exit 1 and one line per problem, each naming the file and
line and what is wrong (a broken link, a docstring reference to nothing, an image that is not there), as
Sphinx words it. Needs the ``docs`` extra: ``pip install -e '.[docs]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent


def problems(warnings: str) -> list[str]:
    """Sphinx's warnings as one line each, paths relative to the repository, without colour codes."""
    lines = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", warnings).splitlines():
        if not line.strip() or line.startswith(" "):
            if lines and line.strip():  # a warning's continuation line (a traceback's last words)
                lines[-1] += " " + line.strip()
            continue
        lines.append(line.replace(f"{ROOT}/", "").replace("WARNING: ", "").replace("ERROR: ", ""))
    return lines


def build(source: Path = DOCS, out: Path = DOCS / "_build" / "html") -> list[str]:
    """Build the site from ``source`` into ``out``; returns the problems (none: it built clean)."""
    try:
        from sphinx.cmd.build import build_main
    except ImportError:
        return ["the docs build needs Sphinx: pip install -e '.[docs]'"]
    with contextlib.suppress(ImportError):  # a fresh machine's first import builds (and logs) its font cache:
        import matplotlib.font_manager  # noqa: F401  # outside the capture, it is no warning
    captured = io.StringIO()
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stderr(captured):
        status = build_main(["-b", "html", "-q", "-W", "--keep-going", "-d", scratch, str(source), str(out)])
    found = problems(captured.getvalue())
    if status and not found:
        found = [f"sphinx-build exited with status {status} and no warning"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "html")
    parser.add_argument("--source", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    found = build(args.source, args.out)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if not found:
        print(f"built {args.out / 'index.html'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
