"""Python-side helpers: run the emulator as a process, and drive its control API.

Contract
--------
* :class:`EmulatorProcess` starts ``[sys.executable, "-m", "streamfence.devtools.emulator",
  "--host", HOST, "--port", "0", "--exit-on-stdin-eof"]`` as a real
  subprocess, waits (up to ``ready_timeout``) for its
  ``EMULATOR_READY http://HOST:PORT`` line, and on stop terminates it,
  kills it if it does not exit within ``stop_timeout``, and always reaps it.
  Failing to start raises :class:`EmulatorError` with the exit status and the
  tail of the emulator's stderr. stderr goes to a temporary file (never a
  pipe nobody reads); :meth:`EmulatorProcess.stderr_tail` returns it.
  Because stdin is a pipe held by this process, the emulator exits by itself
  if this process dies.
* URLs: ``base_url`` is ``http://HOST:PORT`` (no ``/v1``; the control API
  lives under it at ``/_emu/...``); ``openai_base_url`` is ``base_url +
  "/v1"``, what ``openai.OpenAI(base_url=...)`` wants. Started with
  ``tls=(cert, key)``, ``tls_base_url`` is ``https://HOST:TLSPORT``: the
  same routes over TLS.
* :class:`EmulatorClient` speaks the control API with the standard library
  (urllib; no client object to close). Every failure is an
  :class:`EmulatorError` naming the call. :meth:`EmulatorClient.wait_for`
  polls the log until a predicate holds, with a deadline and a message that
  says what was awaited and what the log held instead.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Self, TypeVar

READY_PREFIX = "EMULATOR_READY "

T = TypeVar("T")
Record = dict[str, Any]


class EmulatorError(RuntimeError):
    """The emulator could not be started, or a control call failed."""


class EmulatorClient:
    """Client of the emulator's control API (``/_emu/...``)."""

    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"EmulatorClient({self.base_url!r})"

    def _call(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            with err:
                detail = err.read().decode(errors="replace")
            raise EmulatorError(f"{method} {path} -> HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise EmulatorError(f"{method} {path} failed: {err}") from err

    def script(self, key: str, steps: Sequence[Mapping[str, Any]]) -> None:
        """Replace ``key``'s script; requests with model ``"...#key"`` take its steps in order."""
        self._call("POST", "/_emu/script", {"key": key, "steps": [dict(s) for s in steps]})

    def log(self, key: str | None = None, since: int = 0) -> list[Record]:
        """Request records (all, or those of ``key``), oldest first."""
        query = {k: v for k, v in (("key", key), ("since", since or None)) if v is not None}
        path = "/_emu/log" + ("?" + urllib.parse.urlencode(query) if query else "")
        records: list[Record] = self._call("GET", path)["requests"]
        return records

    def reset(self) -> None:
        """Clear all scripts and the log (request numbers keep increasing)."""
        self._call("POST", "/_emu/reset", {})

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/_emu/health")
        return result

    def wait_for(
        self,
        predicate: Callable[[list[Record]], T | None],
        timeout: float = 5.0,
        what: str = "a log condition",
        *,
        key: str | None = None,
        interval: float = 0.01,
    ) -> T:
        """Poll the log (of ``key``) until ``predicate(records)`` is truthy; return that value.

        Raises :class:`EmulatorError` after ``timeout`` seconds, naming
        ``what`` and summarizing the last log seen.
        """
        deadline = time.monotonic() + timeout
        while True:
            records = self.log(key)
            result = predicate(records)
            if result:
                return result
            if time.monotonic() >= deadline:
                raise EmulatorError(
                    f"timed out after {timeout:.1f}s waiting for {what}; "
                    f"log{f' of key {key!r}' if key else ''}: {summarize(records)}"
                )
            time.sleep(interval)


def summarize(records: Sequence[Record]) -> str:
    """A one-line view of records, for failure messages."""
    if not records:
        return "(no requests)"
    parts = [
        f"n={r['n']} key={r['key']} fault={r['fault']} status={r['status']} "
        f"chunks_sent={r['chunks_sent']} completed={r['completed']} aborted={r['aborted']}"
        for r in records[-10:]
    ]
    more = f"(+{len(records) - 10} earlier) " if len(records) > 10 else ""
    return more + "; ".join(parts)


class EmulatorProcess:
    """The emulator as a child process; a context manager that always reaps it."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        """`tls`: (certificate, key) PEM files: the emulator also serves over
        TLS, at `tls_base_url`."""
        self.host = host
        self.port = port
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args)
        self.env = dict(env) if env is not None else None
        self.tls = tls
        self.base_url = ""
        self.tls_base_url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def anthropic_base_url(self) -> str:
        """``base_url`` itself: the anthropic SDK appends ``/v1/messages``."""
        return self.base_url

    @property
    def openai_base_url(self) -> str:
        """``base_url + "/v1"``: the ``base_url`` for ``openai.OpenAI``."""
        return self.base_url + "/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def __repr__(self) -> str:
        if self._proc is None:
            state = "not started"
        elif (rc := self._proc.poll()) is None:
            state = f"running pid={self._proc.pid} {self.base_url}"
        elif rc < 0:
            state = f"exited by signal {-rc} pid={self._proc.pid}"
        else:
            state = f"exited with {rc} pid={self._proc.pid}"
        return f"<EmulatorProcess {state}>"

    def client(self) -> EmulatorClient:
        if not self.base_url:
            raise EmulatorError("the emulator is not started")
        return EmulatorClient(self.base_url)

    def stderr_tail(self, limit: int = 4000) -> str:
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        size = os.fstat(self._stderr.fileno()).st_size
        with open(self._stderr.fileno(), "rb", closefd=False) as f:
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace")

    def start(self) -> Self:
        if self._proc is not None:
            raise EmulatorError(f"already started: {self!r}")
        cmd = [sys.executable, "-m", "streamfence.devtools.emulator", "--host", self.host, "--port", str(self.port)]
        cmd += ["--exit-on-stdin-eof", *self.extra_args]
        if self.tls is not None:
            cmd += ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]]
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        # Lives as long as the process; closed in stop().
        self._stderr = tempfile.TemporaryFile(prefix="emulator-stderr-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        try:
            urls = self._read_ready_line().split()
            self.base_url = urls[0].rstrip("/")
            if self.tls is not None:
                self.tls_base_url = urls[1].rstrip("/")
        except BaseException:
            self.stop()
            raise
        return self

    def _read_ready_line(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + self.ready_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EmulatorError(
                        f"emulator did not print {READY_PREFIX.strip()} within "
                        f"{self.ready_timeout}s; stderr:\n{self.stderr_tail()}"
                    )
                if not sel.select(left):
                    continue
                data = os.read(fd, 4096)
                if not data:
                    rc = self._proc.wait(timeout=self.stop_timeout)
                    raise EmulatorError(
                        f"emulator exited with status {rc} before it was ready; "
                        f"stderr:\n{self.stderr_tail()}"
                    )
                buf += data
        line = buf.split(b"\n", 1)[0].decode(errors="replace").strip()
        if not line.startswith(READY_PREFIX):
            raise EmulatorError(f"unexpected first line from the emulator: {line!r}")
        return line[len(READY_PREFIX) :].strip()

    def stop(self) -> int | None:
        """Terminate, kill if needed, reap; returns the exit status. Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if self._stderr is not None:
            self._stderr.close()
        return proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def emulator_profile(wire: str, base_url: str) -> dict[str, Any]:
    """A provider profile of kind `wire` for the emulator at `base_url` (no /v1)."""
    if wire == "openai":
        return {"kind": "openai", "base_url": base_url + "/v1"}
    if wire == "anthropic":
        return {"kind": "anthropic", "base_url": base_url}
    if wire == "bedrock":
        return {"kind": "bedrock", "endpoint_url": base_url, "region": "us-east-1",
                "aws_credentials": "dummy"}
    raise ValueError(f"unknown wire {wire!r}")
