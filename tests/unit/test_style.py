"""The code base passes ruff's lint and format checks (configured in pyproject.toml)."""

import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_check_and_format():
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
