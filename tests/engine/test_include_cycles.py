"""csrc/engine's includes form no cycle (tools/include_cycles.py, one node per X.h and X.cpp):
a new cycle fails the suite, naming the includes that close it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_include_cycle():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "include_cycles.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 cycles" in result.stdout, result.stdout
