"""The daemon raises its open-files soft limit to the hard one at start and
says so (a process out of descriptors cannot even accept the connection that
would tell it so). Run in a real child process whose soft limit is lowered
first, as a shell's `ulimit -n 256` would."""

from __future__ import annotations

import resource
import subprocess
import sys

CHILD = """
import logging, resource, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(message)s")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
from streamfence.supervisor.startup import raise_fd_limit
raise_fd_limit(64)
print("limits", *resource.getrlimit(resource.RLIMIT_NOFILE))
raise_fd_limit(hard)  # 256 + 4 x workers_max wanted: more than the hard limit
"""


def test_the_soft_limit_is_raised_to_the_hard_one_and_a_low_one_is_a_warning() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    limits = next(line for line in out if line.startswith("limits "))
    assert limits == f"limits {hard} {hard}", out
    assert f"INFO open files: soft limit {hard} (hard {hard})" in out, out
    assert any(line.startswith("WARNING open-files limit") and f"workers_max={hard}" in line
               for line in out), out
