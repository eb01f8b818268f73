"""What a process needs to reach the cluster (built from the `[cluster]`
table, config/model.py); importing it does not import nats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    urls: tuple[str, ...]
    host: str  # this host's name: unique in the cluster
    replicas: int = 3
    timeout_s: float = 5.0  # per JetStream request
