"""``python -m streamfence.devtools.emulator``: run the provider emulator in the foreground.

Contract
--------
* Binds ``--host`` (default 127.0.0.1) and ``--port`` (default 0 = any free
  port), then prints exactly one line to stdout, flushed:
  ``EMULATOR_READY http://HOST:PORT`` (no ``/v1``), with ``--tls-cert`` and
  ``--tls-key`` followed by `` https://HOST:TLSPORT``: the same emulator
  over TLS on a second free port (the certificate is the caller's; the
  client must trust it). Nothing else goes to stdout; logs (one INFO line
  per request) go to stderr.
* SIGTERM / SIGINT stop it cleanly (in-flight streams get about 0.25 s, then are cut).
* ``--exit-on-stdin-eof``: exit when stdin reaches EOF, so an emulator whose
  parent died (and with it the pipe) does not linger as an orphan.
  :class:`streamfence.devtools.emulator.control.EmulatorProcess` always passes it.
* Exit codes: 0 clean stop, 2 bad arguments (argparse), 3 cannot bind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys

from .app import make_app, start

EXIT_OK = 0
EXIT_BIND_FAILED = 3

logger = logging.getLogger("streamfence.devtools.emulator")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m streamfence.devtools.emulator", description="Run the LLM provider emulator."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--require-auth", action="store_true", help="answer 401 without a bearer token"
    )
    parser.add_argument("--log-limit", type=int, default=100_000, help="request records kept")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS too")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    return args


async def _serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Signal handlers only set the event; the main coroutine does the work.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if args.exit_on_stdin_eof:
        fd = sys.stdin.fileno()

        def _on_stdin() -> None:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
                logger.info("stdin closed: stopping")
                stop.set()

        loop.add_reader(fd, _on_stdin)
    app = make_app(require_auth=args.require_auth, log_limit=args.log_limit)
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    try:
        runner, ports = await start(app, args.host, args.port, tls)
    except OSError as err:
        logger.error("cannot bind %s:%s: %s", args.host, args.port, err)
        return EXIT_BIND_FAILED
    schemes = ("http", "https")[: len(ports)]
    urls = [f"{scheme}://{args.host}:{port}" for scheme, port in zip(schemes, ports, strict=True)]
    logger.info("emulator listening on %s (pid %d)", " and ".join(urls), os.getpid())
    sys.stdout.write(f"EMULATOR_READY {' '.join(urls)}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    logger.info("emulator stopped")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
