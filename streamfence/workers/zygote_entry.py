"""The zygote's entry point as the supervisor names it to `spawn`
(supervisor/zygotechild.py).

The supervisor must hold the target function to start the process, and
streamfence.workers.zygote imports the provider SDKs (~2 s and ~110 MiB per
process on this class of machine, seconds more under load), which the
supervisor never uses: importing it there held every start for that long
before the zygote could even begin its own import (measured under load:
"supervisor up" 4.7 s after the stores were open, 0.04 s without). This
module imports nothing of streamfence at its top (tests/test_architecture.py
holds it to that); the spawned child imports the zygote when it runs
`zygote_main`.
"""

from __future__ import annotations

from typing import Any


def zygote_main(*args: Any) -> None:
    from streamfence.workers.zygote import zygote_main as main

    main(*args)
