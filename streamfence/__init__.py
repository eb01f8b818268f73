"""streamfence: a daemon that runs LLM streaming calls so that they cannot
hang, leak or corrupt a transcript.

The package's parts are the daemon's roles (docs/ARCHITECTURE.md):
`protocol` (the wire and the client library), `supervisor`, `workers` and
`sink` (the daemon's processes), and `devtools` (the provider emulator and
the demo, never imported by the daemon). Applications need only::

    from streamfence import Client, AsyncClient

The names below load on first use (PEP 562): every process of the daemon
imports this package, and none of them needs the client library (asyncio
and the client cost ~0.1-0.3 s of each process's start, more under load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamfence.protocol.client import Client, ClientError
    from streamfence.protocol.client_async import AsyncClient

__all__ = ["AsyncClient", "Client", "ClientError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "ClientError"):
        from streamfence.protocol import client

        return getattr(client, name)
    if name == "AsyncClient":
        from streamfence.protocol.client_async import AsyncClient

        return AsyncClient
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("streamfence")
        except PackageNotFoundError:  # a checkout on sys.path without an install
            return "0+unknown"
    raise AttributeError(f"module 'streamfence' has no attribute {name!r}")
