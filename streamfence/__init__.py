"""streamfence: a daemon that runs LLM streaming calls so that they cannot
hang, leak or corrupt a transcript.

The package's parts are the daemon's roles (docs/ARCHITECTURE.md):
`protocol` (the wire and the client library), `supervisor`, `workers` and
`sink` (the daemon's processes), and `devtools` (the provider emulator and
the demo, never imported by the daemon). Applications need only::

    from streamfence import Client, AsyncClient
"""

from importlib.metadata import PackageNotFoundError, version

from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.client_async import AsyncClient

try:
    __version__ = version("streamfence")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["AsyncClient", "Client", "ClientError", "__version__"]
