"""Process-level test harness (re-exported from supervisor.launcher, which
the demo and the chaos scripts share)."""

from supervisor.launcher import DaemonProcess, wait_until

__all__ = ["DaemonProcess", "wait_until"]
