"""The gateway process: `serve` starts it when `[http] listen` is set and
restarts it with back-off if it dies (docs/ARCHITECTURE.md §4.16), as it
does the sink. It holds no state of its own: a call it started lives in the
daemon, and a client that reconnects finds it there.

Exits with ExitCode.CANNOT_BIND when `listen` is taken (the daemon then
stops, with the reason), 0 on SIGTERM, after its open streams are closed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Any

import uvloop
import zmq

from streamfence.config.model import DaemonConfig
from streamfence.gateway.access import AccessLog
from streamfence.gateway.access import log as access_log
from streamfence.gateway.app import Gateway, keys_dir_of
from streamfence.protocol.internal import Endpoints
from streamfence.protocol.lifecycle import (
    ExitCode,
    die_with_parent,
    expected_parent_pid,
    set_process_title,
)
from streamfence.protocol.logs import route_logs_to

log = logging.getLogger("streamfence.gateway")


def run_gateway(config: DaemonConfig, runtime_dir: str) -> None:
    """Process entry point: serve `config.http.listen` until SIGTERM."""
    set_process_title("gateway")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal's: the supervisor answers it
    ctx: Any = zmq.Context.instance()
    log_sock: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
    log_sock.linger = 1000
    log_sock.connect(Endpoints(runtime_dir).logs)
    route_logs_to(log_sock, config.log_level, "gateway")
    if not die_with_parent(expected_parent_pid()):
        sys.exit(ExitCode.PARENT_GONE)
    try:
        code = uvloop.run(_serve(config))  # libuv's loop: ~10% less CPU per delta (PERFORMANCE.md §9)
    finally:
        logging.shutdown()
        log_sock.close()
    sys.exit(code)


async def _serve(config: DaemonConfig) -> int:
    from aiohttp import web

    runner = web.AppRunner(Gateway(config, keys_dir_of(config)).app(),
                           handler_cancellation=True,  # a client gone cancels its handler
                           access_log_class=AccessLog, access_log=access_log)
    await runner.setup()
    host, port = config.http.host_port
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        log.error("gateway: cannot listen on %s: %s", config.http.listen, exc)
        await runner.cleanup()
        return ExitCode.CANNOT_BIND
    log.info("gateway: serving http://%s/v1 (OpenAI and Anthropic wires)", config.http.listen)
    # What start-up made lives as long as the process: out of the collector's
    # way, or its first young-generation passes walk ~46k objects (12 ms under
    # load) in the middle of a burst (PERFORMANCE.md, "Issue 32: the gateway").
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor owns the order
    await stop.wait()
    log.info("gateway: stopping")
    await runner.cleanup()
    return 0
