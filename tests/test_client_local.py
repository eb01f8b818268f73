"""The client's end of the local events link (protocol/client_local.py):
which endpoints are on this host, and offers it does not take."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.protocol.client_local import LocalEvents, is_local


@pytest.mark.parametrize(("endpoint", "local"), [
    ("ipc:///run/streamfence/client", True),
    ("tcp://127.0.0.1:7755", True),
    ("tcp://127.3.2.1:7755", True),
    ("tcp://localhost:7755", True),
    ("tcp://[::1]:7755", True),
    ("tcp://10.0.0.5:7755", False),
    ("tcp://[2001:db8::1]:7755", False),
    ("tcp://daemon.example:7755", False),
])
def test_only_a_daemon_on_this_host_is_local(endpoint: str, local: bool) -> None:
    assert is_local(endpoint) is local


@pytest.mark.parametrize("offer", [
    None, "path", {"path": "/x"}, {"path": "/x", "token": "not bytes" * 2},
    {"path": "/x", "token": b"short"}, {"path": 7, "token": b"0" * 16}])
def test_a_malformed_offer_is_not_taken(offer: Any) -> None:
    assert LocalEvents.attach(offer, 1 << 20) is None


def test_an_offer_of_a_path_with_nobody_there_is_not_taken(tmp_path: Any) -> None:
    assert LocalEvents.attach({"path": str(tmp_path / "none"), "token": b"0" * 16},
                              1 << 20) is None
