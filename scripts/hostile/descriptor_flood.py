"""Issue 29 item 3: at a 1,024-descriptor limit, a client with no key holds
1,100 connections that never speak, opening again those the daemon closes.
Connections that stay silent are shed before they take the daemon's last
descriptors (supervisor/connections.py), so libzmq's listener never spins
on a failing accept and the daemon answers everyone else."""

from __future__ import annotations

import socket

from scripts.hostile import Attack

NAME = "descriptor flood"
ABOUT = "at 1,024 descriptors, 1,100 idle connections with no key, reopened when closed"
NOFILE = 1024
HELD = 1_100


def attack(a: Attack) -> None:
    path = a.endpoint.removeprefix("ipc://")
    held: list[socket.socket] = []
    try:
        while not a.stop.is_set():
            held = [s for s in held if _open(s)]
            while len(held) < HELD and not a.stop.is_set():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(path)
                except OSError:  # the listen queue is full: next round
                    s.close()
                    break
                held.append(s)
                a.count("idle connections opened")
            a.stop.wait(0.1)
    finally:
        for s in held:
            s.close()


def _open(s: socket.socket) -> bool:
    """Whether the daemon has not closed it (what it sent is read and dropped)."""
    try:
        while s.recv(4096):
            pass
    except BlockingIOError:
        return True
    except OSError:
        pass
    s.close()
    return False


def checks(a: Attack) -> list[tuple[str, bool]]:
    with a.daemon.client() as admin:
        counters = admin.status()["counters"]
    return [("silent connections were shed", counters.get("connections_shed", 0) > 0)]
