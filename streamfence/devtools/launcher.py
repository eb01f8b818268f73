"""Run the real daemon (`streamfence serve`) as a subprocess, for the demo,
the chaos scripts and the tests: write its config, wait until it is ready,
stop it, and kill and reap anything it left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

import psutil
import zmq

from streamfence.protocol.client import Client
from streamfence.protocol.credentials import load_credentials

T = TypeVar("T")


class DaemonExited(RuntimeError):
    """The daemon process exited while it was expected to be running (say,
    while starting); the message holds its exit status and its log's tail."""


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str,
               interval: float = 0.02) -> T:
    """Poll `predicate` until it returns something truthy and return that.

    Raises TimeoutError("timed out after N s waiting for <what>") when it has
    not within `timeout` seconds; an exception of `predicate` propagates."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.3g} s waiting for {what}")
        time.sleep(interval)


def _running(proc: psutil.Process) -> bool:
    """Whether the process still runs. A zombie has exited and counts as gone:
    a daemon's child that outlives the daemon for a moment is reparented to
    PID 1 and is a zombie until PID 1 reaps it, which a container's init may
    do only every second or two (psutil.wait_procs waits for that reaping).
    A pid reused by another process counts as gone too (is_running)."""
    try:
        if not proc.is_running():
            return False
        return bool(proc.status() != psutil.STATUS_ZOMBIE)  # psutil is untyped
    except psutil.NoSuchProcess:
        return False


class DaemonProcess:
    """`streamfence serve --config F --log-json` in a subprocess."""

    def __init__(self, state_dir: Path, providers: dict[str, dict[str, Any]],
                 daemon: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 log_json: bool = True, cwd: Path | None = None,
                 tables: dict[str, dict[str, Any]] | None = None,
                 new_session: bool = False) -> None:
        """`tables`: more tables of the config (say `{"http": {...}}`); a dict
        value in one is written as its subtable. `new_session`: the daemon
        leads a process group of its own (as a shell's job does), for a test
        that signals the whole group."""
        self.state_dir = state_dir
        self._cwd = cwd  # the daemon's working directory (default: ours)
        # ipc paths must be short: keep the front socket in a short temp dir.
        self._short = tempfile.mkdtemp(prefix="sft")
        self.endpoint = f"ipc://{self._short}/front"
        settings: dict[str, Any] = {"endpoint": self.endpoint, "state_dir": str(state_dir),
                                    "workers_spare": 2, "workers_max": 16,
                                    "backoff_base_s": 0.05, "backoff_max_s": 0.2,
                                    "log_level": "INFO"}
        settings.update(daemon or {})
        self._settings = settings
        lines = ["[daemon]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        for name, table in providers.items():
            lines.append(f"[providers.{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
        for name, table in (tables or {}).items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items() if not isinstance(v, dict)]
            for key, sub in table.items():
                if isinstance(sub, dict):
                    lines.append(f"[{name}.{key}]")
                    lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in sub.items()]
        self.config_path = state_dir / "streamfence.toml"
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the daemon refuses others'
        # The admin credentials the daemon writes on its first start (docs/SECURITY.md).
        self.credentials_path = state_dir / "keys" / "local.credentials"
        self.config_path.write_text("\n".join(lines) + "\n")
        self.log_path = state_dir / "daemon.log"
        self._env = env
        self._log_json = log_json
        self._new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self.descendants: set[int] = set()
        self.survivors: list[str] = []

    # ---- lifecycle -------------------------------------------------------------
    def start(self, ready_timeout: float = 60.0) -> Self:
        """Start the daemon and wait until it reports an idle worker.

        Raises TimeoutError if it is not ready within `ready_timeout` seconds
        and DaemonExited if it exits meanwhile; both messages end with the tail
        of its log. The process is left to `stop()` either way."""
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ)
        env.update(self._env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamfence.cli", "serve", "--config", str(self.config_path),
             *(["--log-json"] if self._log_json else [])],
            # No parent-death signal here: it fires when the *thread* that
            # started the daemon exits (a chaos restarter thread, say).
            stdout=self._log_file, stderr=self._log_file, env=env, cwd=self._cwd,
            start_new_session=self._new_session)
        if "auth" not in self._settings or self._settings["auth"] == "curve":
            def credentials_written() -> bool:
                self._check_alive()
                return self.credentials_path.exists()

            try:
                wait_until(credentials_written, ready_timeout, "the daemon's credentials")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; log tail:\n{self.log_text()[-4000:]}") from None
        with self.client(timeout_s=2.0) as client:
            def ready() -> bool:
                self._check_alive()
                try:
                    status = client.status()
                except TimeoutError:
                    return False
                return any(w["state"] == "idle" for w in status["workers"])

            try:
                wait_until(ready, ready_timeout, "the daemon to report an idle worker")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; log tail:\n{self.log_text()[-4000:]}") from None
        self.remember_descendants()
        return self

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise DaemonExited(f"the daemon exited with {self.proc.returncode}; log tail:\n"
                               + self.log_text()[-4000:])

    def remember_descendants(self) -> set[int]:
        assert self.proc is not None
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return self.descendants
        self.descendants |= {k.pid for k in kids}
        return self.descendants

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.remember_descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # No child may outlive the daemon (they die with it by parent-death
        # signal): allow them a moment to go, then kill and report any left.
        procs = []
        for pid in self.descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not any(map(_running, procs)), 2.0, "the daemon's children to go")
        survivors = []
        for p in filter(_running, procs):
            try:
                survivors.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        code = self.proc.returncode
        self.proc = None
        self.survivors = survivors
        return code

    def kill(self) -> None:
        """SIGKILL the supervisor (its children die with it) and wait for it."""
        assert self.proc is not None
        self.remember_descendants()
        self.proc.kill()
        self.proc.wait(timeout=10)

    def cleanup(self) -> None:
        """Stop, and remove the short directory of the front socket."""
        self.stop()
        shutil.rmtree(self._short, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.cleanup()  # __exit__ is not called when __enter__ raises
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # ---- observation -----------------------------------------------------------
    def client(self, timeout_s: float = 10.0, credentials: Path | None = None) -> Client:
        """A client as the daemon's admin (`local`), or with other `credentials`."""
        if credentials is None and self.credentials_path.exists():
            credentials = self.credentials_path
        return Client(self.endpoint, timeout_s=timeout_s, credentials=credentials)

    def socket(self, ctx: zmq.Context[Any], kind: int = zmq.DEALER) -> zmq.Socket[Any]:
        """A raw socket connected to the client endpoint as the admin (for tests
        that speak the wire byte by byte)."""
        sock: zmq.Socket[Any] = ctx.socket(kind)
        sock.linger = 0
        if self.credentials_path.exists():
            load_credentials(self.credentials_path).apply(sock)
        sock.connect(self.endpoint)
        return sock

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> Iterator[dict[str, Any]]:
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue

    def journal_rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(f"file:{self.state_dir / 'journal.db'}?mode=ro", uri=True)
        try:
            return db.execute(sql, args).fetchall()
        finally:
            db.close()

    def transcript_rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(f"file:{self.state_dir / 'transcript.db'}?mode=ro", uri=True)
        try:
            return db.execute(sql, args).fetchall()
        finally:
            db.close()
