"""The zygote's entry point as the supervisor names it to `spawn`.

The supervisor must hold the target function to start the process, and
streamfence.workers.zygote imports the provider SDKs (3-5 s and ~110 MiB on
this class of machine), which the supervisor never uses: importing it there
held every start for those seconds before the zygote could even begin its
own import (measured: "supervisor up" 4.7 s after the stores were open).
This module imports nothing; the spawned child imports the zygote.
"""

from __future__ import annotations

from typing import Any


def zygote_main(*args: Any) -> None:
    from streamfence.workers.zygote import zygote_main as main

    main(*args)
