"""Why a client cannot reach the daemon, said at once (client_monitor.py), and the
key changes the daemon applies (protocol/keys.py), through a real daemon with
real CURVE, the real `Client`/`AsyncClient` and the real `streamfence` CLI.

Each cause must come with its own message within a second; the tests allow
3 s (a liveness bound on a loaded machine, not a benchmark) and print the
time it took.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from time import monotonic

import pytest

from streamfence.protocol.client import AsyncClient, Client, NoConnection
from streamfence.protocol.client_monitor import KEY_REFUSED, NO_CREDENTIALS, NO_DAEMON, WRONG_DAEMON
from streamfence.protocol.credentials import (
    ENV_CREDENTIALS,
    Credentials,
    load_credentials,
    write_credentials,
)
from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, free_port, wait_until
from tests.wires import DaemonFactory

pytestmark = pytest.mark.slow

BOUND_S = 3.0
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({"openai": "openai"})


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No STREAMFENCE_* variable, here and for the CLI's processes."""
    for name in [n for n in os.environ if n.startswith("STREAMFENCE_")]:
        monkeypatch.delenv(name)
    return dict(os.environ)


def _refused(endpoint: str | None, credentials: Credentials | Path | None) -> NoConnection:
    """The NoConnection both clients raise for `status`, each within BOUND_S."""
    t0 = monotonic()
    with Client(endpoint, 10.0, credentials=credentials) as client, \
            pytest.raises(NoConnection) as caught:
        client.status()
    took = monotonic() - t0
    print(f"Client: {caught.value.cause} after {took:.3f} s: {caught.value}")
    assert took < BOUND_S, f"{caught.value.cause} took {took:.2f} s"

    async def main() -> NoConnection:
        t0 = monotonic()
        with AsyncClient(endpoint, 10.0, credentials=credentials) as client, \
                pytest.raises(NoConnection) as caught:
            await client.status()
        took = monotonic() - t0
        print(f"AsyncClient: {caught.value.cause} after {took:.3f} s")
        assert took < BOUND_S, f"{caught.value.cause} took {took:.2f} s"
        return caught.value
    again = asyncio.run(main())
    assert (again.cause, str(again)) == (caught.value.cause, str(caught.value))
    return caught.value


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         ok: bool = False) -> subprocess.CompletedProcess[str]:
    t0 = monotonic()
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=cwd)
    print(f"streamfence {' '.join(args)}: exit {proc.returncode} after {monotonic() - t0:.2f} s "
          f"(with the interpreter's start): {proc.stderr.strip()}")
    assert (proc.returncode == 0) == ok, proc.stderr
    return proc


def test_no_daemon_at_the_endpoint(daemon: DaemonProcess, clean_env: dict[str, str]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    exc = _refused(endpoint, daemon.credentials_path)
    assert exc.cause == NO_DAEMON and isinstance(exc, TimeoutError)
    assert str(exc).startswith(f"no daemon at {endpoint}: nothing accepts connections there")
    assert f"were made for {daemon.endpoint}" in str(exc)  # local's credentials name another
    out = _cli("status", "--config", str(daemon.config_path), "--endpoint", endpoint,
               env=clean_env)
    assert f"no daemon at {endpoint}: nothing accepts" in out.stderr


def test_refused_credentials(daemon: DaemonProcess, clean_env: dict[str, str],
                             tmp_path: Path) -> None:
    config = str(daemon.config_path)
    _cli("keys", "new", "eve", "--config", config, ok=True)
    eve = load_credentials(daemon.state_dir / "keys" / "eve.credentials")
    kept = tmp_path / "eve.credentials"
    write_credentials(kept, eve)
    _cli("keys", "revoke", "eve", "--config", config, ok=True)
    exc = _refused(None, kept)
    assert exc.cause == KEY_REFUSED
    assert str(exc).startswith(f"the daemon at {daemon.endpoint} refused the credentials of "
                               f"'eve': their key is not registered with it")
    out = _cli("status", "--credentials", str(kept), env=clean_env)
    assert "refused the credentials of 'eve'" in out.stderr and str(kept) in out.stderr


def test_no_credentials(daemon: DaemonProcess, clean_env: dict[str, str],
                        tmp_path: Path) -> None:
    exc = _refused(daemon.endpoint, None)
    assert exc.cause == NO_CREDENTIALS
    assert "takes only CURVE clients, and this client has no credentials: pass " \
           f"credentials=PATH to Client (--credentials PATH to the CLI) or set " \
           f"${ENV_CREDENTIALS}=PATH" in str(exc)
    # The CLI run from another directory: no config there, so the defaults' state dir.
    out = _cli("status", "--endpoint", daemon.endpoint, env=clean_env, cwd=tmp_path)
    looked = tmp_path / "streamfence-state" / "keys" / "local.credentials"
    assert f"the daemon at {daemon.endpoint} takes only CURVE clients, and no credentials " \
           f"were found: no --credentials, ${ENV_CREDENTIALS} is not set, and there is no " \
           f"{looked} (the state dir of the defaults: no --config, $STREAMFENCE_CONFIG or " \
           f"./streamfence.toml)" in out.stderr


def test_credentials_made_for_another_endpoint(daemon: DaemonProcess, clean_env: dict[str, str],
                                               tmp_path: Path) -> None:
    other = f"tcp://127.0.0.1:{free_port()}"
    KeyStore(tmp_path / "other" / "keys").register("alice", other)
    path = tmp_path / "other" / "keys" / "alice.credentials"
    exc = _refused(daemon.endpoint, path)
    assert exc.cause == WRONG_DAEMON
    assert str(exc) == (f"the daemon at {daemon.endpoint} is not the one the credentials of "
                        f"'alice' were made for: it does not hold their server_key (they were "
                        f"made for {other})")
    out = _cli("status", "--endpoint", daemon.endpoint, "--credentials", str(path),
               env=clean_env)
    assert f"(they were made for {other})" in out.stderr


def test_the_readme_client_snippet_works_as_written(daemon: DaemonProcess,
                                                    clean_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """Run from a directory like `try/`, whose state dir is ./streamfence-state."""
    snippet = re.search(r"```python\n(from streamfence import Client\n.*?)```",
                        README.read_text(), re.S)
    assert snippet is not None, "README's Client snippet"
    (tmp_path / "streamfence-state").symlink_to(daemon.state_dir)
    proc = subprocess.run([sys.executable, "-c", snippet.group(1)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=clean_env)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


# ---- keys ---------------------------------------------------------------------------

def _logged(daemon: DaemonProcess, line: str) -> None:
    wait_until(lambda: line in daemon.log_text(), 10, f"the daemon to log {line!r}")


def test_the_daemon_logs_every_key_change_by_name(daemon: DaemonProcess) -> None:
    config = str(daemon.config_path)
    path = daemon.state_dir / "keys" / "frank.credentials"
    _cli("keys", "new", "frank", "--config", config, ok=True)
    _logged(daemon, "client keys: identity 'frank' added")
    first = load_credentials(path)
    _cli("keys", "rotate", "frank", "--config", config, ok=True)
    _logged(daemon, "client keys: identity 'frank' rotated")
    second = load_credentials(path)
    _cli("keys", "revoke", "frank", "--config", config, ok=True)
    _logged(daemon, "client keys: identity 'frank' revoked")
    log = daemon.log_text()
    for key in (first.public_key, first.secret_key, second.public_key, second.secret_key):
        assert key.decode() not in log


def test_revoking_the_last_admin_needs_force(daemon: DaemonProcess,
                                             clean_env: dict[str, str]) -> None:
    config = str(daemon.config_path)
    out = _cli("keys", "revoke", "local", "--config", config)
    assert "local is the last admin identity" in out.stderr and "--force" in out.stderr
    assert "local" in _cli("keys", "list", "--config", config, ok=True).stdout.split()
    with daemon.client() as client:
        assert client.status()["identity"] == "local"
    _cli("keys", "revoke", "local", "--force", "--config", config, ok=True)
    _logged(daemon, "client keys: identity 'local' revoked")
    try:
        out = _cli("status", "--config", config, env=clean_env)
        # its credentials file went with it: the CLI finds none, and says where it looked
        assert "no credentials were found" in out.stderr
    finally:
        _cli("keys", "new", "local", "--config", config, ok=True)
    _logged(daemon, "client keys: identity 'local' added")
    with daemon.client() as client:
        assert client.status()["identity"] == "local"
