"""supervisor/reload.py's pure parts: what a new config changes, what a
reload applies and keeps, and how it says so (the daemon's side:
tests/test_reload_e2e.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from streamfence.config.identities import Identity
from streamfence.config.model import ClusterConfig, DaemonConfig, ProviderProfile, load_config
from streamfence.supervisor import reload

OLD = DaemonConfig(
    providers={"a": ProviderProfile("a", "openai"), "b": ProviderProfile("b", "anthropic"),
               "c": ProviderProfile("c", "bedrock")},
    identities={"alice": Identity("alice", max_in_flight=2)},
    config_path="/etc/streamfence.toml")


def test_what_changed_is_named_by_key_never_by_value() -> None:
    new = replace(OLD, providers={"a": ProviderProfile("a", "openai", base_url="http://x:1/v1",
                                                       read_timeout_s=9.0),
                                  "b": OLD.providers["b"], "d": ProviderProfile("d", "openai")},
                  identities={"alice": Identity("alice", max_in_flight=1),
                              "bob": Identity("bob")},
                  log_level="DEBUG")
    changes = reload.compare(OLD, new)
    assert changes.lines() == [
        "reload: providers: added d; changed a (base_url, read_timeout_s); removed c",
        "reload: identities: added bob; changed alice (max_in_flight)",
        "reload: log level INFO -> DEBUG"]
    assert changes.need_restart == []
    assert not any("http://x:1" in line for line in changes.lines())


def test_what_needs_a_restart_keeps_its_value() -> None:
    new = replace(OLD, endpoint="tcp://127.0.0.1:9999", workers_spare=4,
                  cluster=ClusterConfig(urls=("nats://u:secret@h:4222",), host="h"),
                  providers={})
    changes = reload.compare(OLD, new)
    assert changes.need_restart == ["endpoint", "workers_spare", "cluster"]
    running = reload.applied(OLD, new)
    assert running.providers == {} and running.config_path == OLD.config_path
    assert (running.endpoint, running.workers_spare, running.cluster) == (
        OLD.endpoint, OLD.workers_spare, OLD.cluster)


def test_the_same_file_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    changes = reload.compare(OLD, replace(OLD))
    assert changes.lines() == [] and changes.need_restart == []
    with caplog.at_level(logging.INFO, "streamfence.supervisor"):
        reload.log_changes(changes, OLD.config_path)
    assert [r.getMessage() for r in caplog.records] == [
        "reload: /etc/streamfence.toml read again; nothing to apply changed"]


def test_an_invalid_file_is_refused_one_line_per_problem(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "streamfence.toml"
    path.write_text('[daemon]\nlog_level = "INFO"\n[providers.a]\nkind = "openai"\n')
    current = load_config(str(path), env={})
    path.write_text('[daemon]\nlog_levle = "DEBUG"\n[providers.a]\nkind = "opnai"\n')
    with caplog.at_level(logging.ERROR, "streamfence.supervisor"):
        assert reload.read_again(current, lambda p: load_config(p, env={})) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert all(line.startswith(f"reload refused, the running config stays: {path}: ")
               for line in lines), lines
    assert "daemon.log_levle" in lines[0] and "providers.a.kind" in lines[1], lines


def test_a_daemon_on_the_defaults_has_nothing_to_read(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "streamfence.supervisor"):
        assert reload.read_again(DaemonConfig()) is None
    assert "no config file" in caplog.records[0].getMessage()
