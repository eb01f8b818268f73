"""A new operator's first hour (issue 14): `streamfence init`, `emulator`,
`serve` on the written config, `submit` with only `--provider`, `--version`,
and the demo's 80-column output, `--keep` and Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path
from typing import Any

import click
import psutil
import pytest
from click.testing import CliRunner
from rich.console import Console

from streamfence.cli import main, resolve_wire
from streamfence.cli.config_template import (
    COMMON_PROFILE_KEYS,
    DAEMON_DOCS,
    EMULATOR_URL,
    IDENTITY_DOCS,
    KIND_KEYS,
    PROFILE_DOCS,
    render,
)
from streamfence.config import identities
from streamfence.config.model import (
    ClusterConfig,
    DaemonConfig,
    ProviderProfile,
    load_config,
    parse_config,
)
from streamfence.devtools import demo
from streamfence.devtools.emulator.control import EmulatorClient, emulator_profile
from streamfence.protocol.client import Client
from streamfence.protocol.wires import WIRES
from tests.harness import wait_until

UNCOMMENT = re.compile(r"^# (?=[a-z_]+ = )", re.MULTILINE)  # `# key = value`, not `#   key`


def _daemon_keys() -> list[str]:
    return [f.name for f in fields(DaemonConfig)
            if f.name not in ("providers", "groups", "identities", "prices", "http", "cluster",
                              "tracing", "config_path")]


# ---- the config `init` writes ---------------------------------------------------------


def test_every_key_of_the_config_is_documented() -> None:
    assert set(DAEMON_DOCS) == set(_daemon_keys())
    profile_keys = {f.name for f in fields(ProviderProfile)} - {"name"}
    assert set(PROFILE_DOCS) == profile_keys
    for kind, keys in KIND_KEYS.items():
        assert {"kind", *keys, *COMMON_PROFILE_KEYS} <= profile_keys, kind
    assert {"kind", *COMMON_PROFILE_KEYS}.union(*KIND_KEYS.values()) == profile_keys
    assert set(IDENTITY_DOCS) == identities._KEYS


def test_the_written_config_is_the_defaults_with_a_profile_per_wire(tmp_path: Path) -> None:
    state = str(tmp_path / "streamfence-state")
    text = render(state, "http://127.0.0.1:9999")
    assert all(len(line) <= 79 or " = " in line for line in text.splitlines())
    path = tmp_path / "streamfence.toml"
    path.write_text(text)
    cfg = load_config(str(path), env={})
    defaults = DaemonConfig()
    for key in _daemon_keys():
        assert getattr(cfg, key) == (state if key == "state_dir" else getattr(defaults, key)), key
        assert re.search(rf"^(# )?{key} = ", text, re.MULTILINE), f"{key} is not written"
    assert sorted(cfg.providers) == sorted(WIRES)
    for wire in WIRES:
        written = {k: v for k, v in cfg.providers[wire].to_map().items()
                   if k != "name" and v != getattr(ProviderProfile("x", "x"), k)}
        assert written == emulator_profile(wire, "http://127.0.0.1:9999"), wire
    assert cfg.identities == {}


def test_uncommenting_every_default_changes_nothing(tmp_path: Path) -> None:
    """What `# key = value` shows is the default, and is valid where it stands."""
    path = tmp_path / "streamfence.toml"
    text, count = UNCOMMENT.subn("", render(str(tmp_path / "s")))
    assert count > len(_daemon_keys())
    path.write_text(text)
    cfg = load_config(str(path), env={})
    defaults = DaemonConfig()
    for key in _daemon_keys():
        if key != "state_dir":
            assert getattr(cfg, key) == getattr(defaults, key), key
    bare = ProviderProfile("x", "x")
    for wire in WIRES:
        profile = cfg.providers[wire]
        for key in COMMON_PROFILE_KEYS:
            if getattr(bare, key) is not None:  # an unset default shows an example value
                assert getattr(profile, key) == getattr(bare, key), (wire, key)
    # The example identity is commented as a block (`#   `): it stays out.
    assert cfg.identities == {}
    table = "\n".join(line[4:] for line in text.splitlines() if line.startswith("#   "))
    assert set(tomllib.loads(table[table.index("[identities.alice]"):])["identities"]["alice"]) \
        == identities._KEYS
    # So is the [http] example, and it is valid with the written profiles.
    assert cfg.http.listen is None
    example = tomllib.loads(table[table.index("[http]"):table.index("[cluster]")])
    with_http = load_config(str(path), env={})
    assert parse_config({"providers": {n: {"kind": p.kind} for n, p in
                                       with_http.providers.items()},
                         **example}).http.listen == "127.0.0.1:7757"
    # And the [cluster] example: every key of the table, valid.
    assert not cfg.cluster.enabled
    example = tomllib.loads(table[table.index("[cluster]"):table.index("[identities.alice]")])
    assert set(example["cluster"]) == {f.name for f in fields(ClusterConfig)}
    assert parse_config(example).cluster.host == "host-a"


def test_init_writes_into_dir_and_refuses_to_overwrite(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "new"
    first = runner.invoke(main, ["init", str(target)])
    assert first.exit_code == 0, first.output
    path = target / "streamfence.toml"
    cfg = load_config(str(path), env={})
    assert cfg.state_dir == str(target.resolve() / "streamfence-state")
    assert cfg.providers["openai"].base_url == EMULATOR_URL + "/v1"
    assert "streamfence emulator" in first.output
    path.write_text(path.read_text() + "# mine\n")
    again = runner.invoke(main, ["init", str(target), "--emulator-url", "http://127.0.0.1:1"])
    assert again.exit_code == 1
    assert "exists" in again.output and "--force" in again.output, again.output
    assert path.read_text().endswith("# mine\n")
    forced = runner.invoke(main, ["init", str(target), "--force",
                                  "--emulator-url", "http://127.0.0.1:1/"])
    assert forced.exit_code == 0, forced.output
    assert load_config(str(path), env={}).providers["anthropic"].base_url == "http://127.0.0.1:1"
    bad = runner.invoke(main, ["init", str(target), "--force", "--emulator-url", "127.0.0.1:1"])
    assert bad.exit_code == 2 and "--emulator-url" in bad.output, bad.output


# ---- submit and --version --------------------------------------------------------------


def test_submit_takes_the_wire_from_the_profile() -> None:
    profiles = {"claude": "anthropic", "br": "bedrock", "gpt": "openai", "group": "bedrock"}
    assert resolve_wire(profiles, "group", None) == ("bedrock", False)  # a model group's kind
    assert resolve_wire(profiles, "claude", None) == ("anthropic", False)
    assert resolve_wire(profiles, "br", None) == ("bedrock", False)
    assert resolve_wire(profiles, "claude", "anthropic") == ("anthropic", False)
    assert resolve_wire(profiles, "elsewhere", None) == ("openai", True)  # a guess
    assert resolve_wire(profiles, "elsewhere", "bedrock") == ("bedrock", False)
    with pytest.raises(click.UsageError, match="'claude' is of kind anthropic"):
        resolve_wire(profiles, "claude", "openai")


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"streamfence, version {version('streamfence')}\n"


# ---- the demo: 80 columns, --keep, Ctrl-C ---------------------------------------------


def _rendered(*things: Any) -> list[str]:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    with contextlib.closing(console.file):
        for thing in things:
            console.print(thing)
    return console.export_text().splitlines()


def test_the_demo_table_and_legend_fit_80_columns() -> None:
    board = demo.Board(list(WIRES))
    for r in (1, 2):
        for scenario in demo.SCENARIOS:
            for i, wire in enumerate(WIRES):
                key = f"{wire}-{scenario.name}-{r}"
                board.add(key, f"{scenario.name} {r}", wire, scenario.expect)
                state = ("streaming", "reset", "queued", scenario.expect)[(i + r) % 4]
                board.update(key, state=state, attempt=2, chars=1234)
    lines = _rendered(demo.legend(list(WIRES)), board.table())
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text, text
    for needle in ("zombie-restart 2", "#2 completed", "#2 1234 chars", "#2 reset", "queued",
                   "anthropic", "bedrock", "partial", "failed"):
        assert needle in text, needle
    for scenario in demo.SCENARIOS:  # the legend
        assert scenario.name in text
        assert " ".join(scenario.what.split()[:3]) in text


@pytest.mark.parametrize(("passed", "keep", "kept"), [
    (True, False, False), (True, True, True), (False, False, True)])
def test_the_demo_keeps_its_work_dir_after_a_fail_or_with_keep(
        monkeypatch: pytest.MonkeyPatch, passed: bool, keep: bool, kept: bool) -> None:
    seen: list[Path] = []

    def run(rounds: int, wires: list[str], console: Console, workdir: Path,
            ctrl_c: demo.CtrlC) -> bool:
        (workdir / "state").mkdir()
        seen.append(workdir)
        return passed

    monkeypatch.setattr(demo, "_run", run)
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    with contextlib.closing(console.file):
        assert demo.run_demo(console=console, keep=keep) is passed
    try:
        assert seen[0].exists() is kept
        assert (f"kept for a look: {seen[0]}/" in console.export_text()) is kept
    finally:
        shutil.rmtree(seen[0], ignore_errors=True)


def test_a_second_ctrl_c_kills_at_once_and_says_so() -> None:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    killed: list[str] = []
    ctrl_c = demo.CtrlC(console)
    ctrl_c.kill_now += [lambda: killed.append("daemon"), lambda: killed.append("emulator")]
    with contextlib.closing(console.file), ctrl_c.installed():
        installed: object = signal.getsignal(signal.SIGINT)  # object: no narrowing of ctrl_c
        assert installed is ctrl_c
        with pytest.raises(KeyboardInterrupt):
            ctrl_c(signal.SIGINT, None)
        assert killed == []
        with pytest.raises(KeyboardInterrupt):
            ctrl_c(signal.SIGINT, None)
        assert killed == ["daemon", "emulator"]
    assert signal.getsignal(signal.SIGINT) is not ctrl_c
    text = console.export_text()
    assert "Ctrl-C again: at once" in text and "second Ctrl-C: killing" in text, text


# ---- init, emulator, serve, submit: the README's path, end to end ----------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamfence.cli", *args]


def _first_line(proc: subprocess.Popen[bytes], timeout: float, what: str) -> str:
    assert proc.stdout is not None
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line from {what} within {timeout} s")
            if sel.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"{what} exited with {proc.wait(5)} before its line")
                buf += chunk
    return buf.split(b"\n", 1)[0].decode()


@contextlib.contextmanager
def _running(cmd: list[str], **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A process that must stop cleanly on SIGTERM, with every child it started."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **kw)
    kids: set[psutil.Process] = set()
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            kids = set(psutil.Process(proc.pid).children(recursive=True))
        proc.terminate()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=10)
        _, alive = psutil.wait_procs(list(kids), timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0, f"{cmd[3]} exited {code} on SIGTERM"
    assert not alive, f"processes outlived {cmd[3]}: {alive}"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_init_serve_and_submit_on_each_wire_with_only_the_provider(tmp_path: Path) -> None:
    """As the README's "Try it against the emulator" goes: `streamfence emulator`,
    `streamfence init`, `streamfence serve` and `streamfence submit --provider X`
    in that directory, each a real process. Two environment overrides (the
    README's STREAMFENCE_<KEY>): an ipc endpoint, so that parallel tests need no
    free port pair, and 2 spare workers instead of 32, to spare CI's CPU."""
    home = tmp_path / "first-hour"
    home.mkdir()
    short = tempfile.mkdtemp(prefix="sft")  # ipc paths must be short
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    env |= {"STREAMFENCE_ENDPOINT": f"ipc://{short}/front", "STREAMFENCE_WORKERS_SPARE": "2"}
    try:
        with _running(_cli("emulator", "--port", "0"), stdout=subprocess.PIPE,
                      stderr=subprocess.DEVNULL, env=env) as emulator:
            url = _first_line(emulator, 30, "`streamfence emulator`").split()[-1]
            emu = EmulatorClient(url)
            init = subprocess.run(_cli("init", "--emulator-url", url), cwd=home, env=env,
                                  capture_output=True, text=True, timeout=30)
            assert init.returncode == 0, init.stderr
            assert (home / "streamfence.toml").exists()
            log_path = home / "serve.log"
            with open(log_path, "wb") as log, \
                    _running(_cli("serve"), cwd=home, env=env, stdout=log, stderr=log) as serve:
                _wait_ready(serve, home, log_path)
                log_text = log_path.read_text()
                assert f"config: {home / 'streamfence.toml'}" in log_text, log_text
                assert f"state dir: {home / 'streamfence-state'}" in log_text, log_text
                assert f"anthropic (anthropic, {url})" in log_text, log_text
                for wire in WIRES:
                    before = max((r["n"] for r in emu.log()), default=0)
                    submit = subprocess.run(_cli("submit", "--provider", wire), cwd=home,
                                            env=env, capture_output=True, text=True, timeout=60)
                    assert submit.returncode == 0, (wire, submit.stderr)
                    sent = emu.log(since=before)
                    assert len(sent) == 1, (wire, sent)
                    assert submit.stdout == sent[0]["text"] + "\n", (wire, submit.stdout)
                    assert "[completed]" in submit.stderr, submit.stderr
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _wait_ready(serve: subprocess.Popen[bytes], home: Path, log_path: Path) -> None:
    credentials = home / "streamfence-state" / "keys" / "local.credentials"

    def alive() -> None:
        if serve.poll() is not None:
            raise AssertionError(f"serve exited with {serve.returncode}:\n"
                                 f"{log_path.read_text()[-3000:]}")

    def written() -> bool:
        alive()
        return credentials.exists()

    def idle_worker() -> bool:
        alive()
        try:
            status = client.status()
        except TimeoutError:
            return False
        return any(w["state"] == "idle" for w in status["workers"])

    try:
        wait_until(written, 30, "the daemon's admin credentials in the state dir init chose")
        with Client(None, timeout_s=2.0, credentials=credentials) as client:
            wait_until(idle_worker, 60, "the daemon to report an idle worker")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; serve's log:\n{log_path.read_text()[-3000:]}") from None
