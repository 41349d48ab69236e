"""The project's lint configuration (pyproject.toml, [tool.ruff]) holds for the whole tree, so
the habits it encodes are checked on every CI run, not just written down."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, ("ruff check (pyproject.toml's rules) failed; run `ruff check "
                                 "--fix` or fix by hand:\n"
                                 + res.stdout[-4000:] + res.stderr[-2000:])
