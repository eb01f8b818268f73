"""The `[tracing]` table: OpenTelemetry traces of calls and attempts, sent
over OTLP/HTTP (docs/ARCHITECTURE.md, "Traces"). No `endpoint`: no traces,
and the opentelemetry packages are never imported.

Headers the collector needs (an API key) come from the exporter's own
environment variables (OTEL_EXPORTER_OTLP_TRACES_HEADERS or
OTEL_EXPORTER_OTLP_HEADERS), never from this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from streamfence.config.problems import Types, typed

TRACING_TYPES: Types = {"endpoint": (str,), "service_name": (str,), "timeout_s": (int, float)}


@dataclass(frozen=True, slots=True)
class TracingConfig:
    endpoint: str = ""  # the collector's OTLP/HTTP traces URL, e.g. http://HOST:4318/v1/traces
    service_name: str = "streamfence"  # the spans' resource `service.name`
    timeout_s: float = 10.0  # per export request

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def parse_tracing(table: dict[str, Any], where: str, problems: list[str],
                  homes: Mapping[str, str]) -> TracingConfig:
    """The valid part of `[tracing]`; each problem added to `problems`."""
    values = typed(table, where, TRACING_TYPES, problems, homes)
    endpoint = values.get("endpoint", "")
    url = urlparse(endpoint)
    if endpoint and (url.scheme not in ("http", "https") or not url.hostname):
        problems.append(f"{where}.endpoint: must be an http:// or https:// URL (OTLP/HTTP), "
                        f"got {endpoint!r}")
        values.pop("endpoint")
    if url.username or url.password:
        problems.append(f"{where}.endpoint: must not carry credentials; set "
                        f"OTEL_EXPORTER_OTLP_TRACES_HEADERS in the daemon's environment")
        values.pop("endpoint", None)
    if not values.get("service_name", "x"):
        problems.append(f"{where}.service_name: must not be empty")
        values.pop("service_name")
    if "timeout_s" in values and not 0 < values["timeout_s"] <= 300:
        problems.append(f"{where}.timeout_s: must be in (0, 300] seconds")
        values.pop("timeout_s")
    return TracingConfig(**values)
