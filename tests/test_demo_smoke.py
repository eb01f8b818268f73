"""The README's main job: `streamfence demo` runs to a PASS verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.mark.timeout(180)
def test_demo_runs_to_a_passing_verdict() -> None:
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "demo", "--wire", "openai"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "PASS" in proc.stdout
    assert "lost (must be 0)" in proc.stdout
