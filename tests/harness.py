"""Process-level test harness (re-exported from streamfence.devtools.launcher, which
the demo and the chaos scripts share)."""

from streamfence.devtools.launcher import DaemonProcess, wait_until

__all__ = ["DaemonProcess", "wait_until"]
