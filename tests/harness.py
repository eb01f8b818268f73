"""Process-level test harness (re-exported from streamfence.devtools.launcher, which
the demo and the chaos scripts share), and checks the end-to-end tests share."""

from typing import Any

from streamfence.devtools.launcher import DaemonProcess, wait_until

__all__ = ["DaemonProcess", "assert_one_exact_answer", "process_state", "wait_until"]


def process_state(pid: int) -> str:
    """The process's state letter in /proc (`T`: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def assert_one_exact_answer(events: list[dict[str, Any]], sent: list[dict[str, Any]]) -> None:
    """The call's events, as a subscriber received them, are one completed
    answer: seqs 1, 2, 3 ... with no reset, whose text is exactly what the
    emulator sent for its one request (`sent`: the emulator's log of the key)."""
    done = events[-1]
    assert done["status"] == "completed", done
    assert len(sent) == 1, f"the provider was asked {len(sent)} times"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert not any(e["op"] == "reset" for e in events)
    text = "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == "text")
    assert done["response"]["content"] == text == sent[0]["text"]
