"""No attack: one more well-behaved client, so that the probe's figures
with an attack have figures without one beside them (same daemon settings,
same run)."""

from __future__ import annotations

from scripts.hostile import Attack
from streamfence.protocol.client import Client

NAME = "baseline"
ABOUT = "no attack: one more client saying status every 0.1 s"


def attack(a: Attack) -> None:
    with Client(a.endpoint, 5.0, credentials=a.register("neighbour")) as c:
        while not a.stop.wait(0.1):
            c.status()
            a.count("status")
