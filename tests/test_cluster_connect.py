"""Reaching the NATS cluster as `[cluster]` says (cluster/connect.py,
cluster/settings.py): a password the servers require, TLS with a CA and a
client certificate, and a start that cannot reach the cluster ending in
one line that names the servers and the reason, no traceback, within
`timeout_s` (`connect` on its own: the daemon's start and exit around it
take seconds more on a loaded machine, which is not what is tested); never
a password shown."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.cluster.connect import AccessError, Unreachable, client_options, connect
from streamfence.cluster.settings import ClusterSettings, NatsAuth, NatsTls, shown_url
from streamfence.config.model import ConfigError, parse_config
from streamfence.devtools import nats_cluster
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonExited
from tests.harness import DaemonProcess, free_port, wait_until
from tests.wires import profile_for

USER, PASSWORD = "streamfence", "s3cret-pass"


# ---- the tables and what is shown ---------------------------------------------------
def _cluster(**more: Any) -> dict[str, Any]:
    return {"cluster": {"urls": ["nats://127.0.0.1:4222"], "host": "host-a", **more}}


def test_auth_and_tls_tables_parse_and_bad_ones_name_their_key() -> None:
    cfg = parse_config(_cluster(auth={"user": "u", "password_env": "NATS_PW"},
                                tls={"ca": "/ca.pem", "verify": False}), "f.toml").cluster
    assert cfg.auth == NatsAuth(user="u", password_env="NATS_PW")
    assert cfg.tls == NatsTls(ca="/ca.pem", verify=False) and cfg.tls.configured
    bad: list[tuple[dict[str, Any], str]] = [({"auth": {"creds": "/a", "user": "u", "password_env": "P"}},
            "f.toml: cluster.auth: one of creds, nkey_seed or user, got creds and user"),
           ({"auth": {"user": "u"}}, "f.toml: cluster.auth: user and password_env go together"),
           ({"auth": {"password": "x"}}, "f.toml: cluster.auth.password: unknown key"),
           ({"auth": {"user": "u", "password_env": "NOT A NAME"}},
            "f.toml: cluster.auth.password_env: the name of an environment variable"),
           ({"tls": {"cert": "/c.pem"}}, "f.toml: cluster.tls: cert and key go together"),
           ({"tls": {"verify": "no"}}, "f.toml: cluster.tls.verify: expected bool, got str"),
           ({"tls": {"ca": ""}}, "f.toml: cluster.tls.ca: must not be empty"),
           ({"tls": "yes"}, "f.toml: cluster.tls: must be a table")]
    for table, message in bad:
        with pytest.raises(ConfigError) as caught:
            parse_config(_cluster(**table), "f.toml")
        assert str(caught.value).startswith(message), (table, str(caught.value))


def test_a_password_in_a_url_is_never_shown() -> None:
    assert shown_url("nats://u:pw@10.0.0.1:4222") == "nats://u:***@10.0.0.1:4222"
    assert shown_url("tls://10.0.0.1:4222") == "tls://10.0.0.1:4222"
    assert shown_url("nats://token@h:1") == "nats://token@h:1"  # a user (or token) alone
    settings = ClusterSettings(("nats://a:pw@h1:1", "nats://h2:2"), "host-a")
    assert settings.shown_urls == "nats://a:***@h1:1, nats://h2:2"
    with pytest.raises(ConfigError) as caught:
        parse_config({"cluster": {"urls": ["http://u:pw@h:1"], "host": "a"}})
    assert "pw" not in str(caught.value) and "u:***@h:1" in str(caught.value)


def test_files_and_variables_that_cannot_be_used_name_their_key(tmp_path: Path) -> None:
    def refused(**kwargs: Any) -> str:
        with pytest.raises(AccessError) as caught:
            client_options(ClusterSettings(("nats://h:1",), "a", **kwargs))
        return str(caught.value)

    missing = str(tmp_path / "none")
    assert refused(auth=NatsAuth(creds=missing)).startswith(
        f"cluster.auth.creds: cannot read {missing}: No such file")
    assert refused(auth=NatsAuth(nkey_seed=missing)).startswith("cluster.auth.nkey_seed: ")
    assert refused(auth=NatsAuth(user="u", password_env="SF_TEST_UNSET_PW")) == (
        "cluster.auth.password_env: the environment variable SF_TEST_UNSET_PW is not set")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert refused(tls=NatsTls(ca=str(junk))).startswith(f"cluster.tls.ca: {junk} is not usable")
    assert refused(tls=NatsTls(cert=str(junk), key=str(junk))).startswith("cluster.tls.cert: ")


# ---- a start that cannot reach the cluster ------------------------------------------
def _refused_start(proc: DaemonProcess) -> tuple[int | None, list[str]]:
    """Start `proc`, which must exit (not hang: within a minute): its status
    and its log's lines."""
    with pytest.raises(DaemonExited):
        proc.start(ready_timeout=60)
    return proc.stop(), proc.log_text().splitlines()


def _assert_one_line(code: int | None, lines: list[str], *expected: str) -> str:
    assert code not in (0, None), code
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    refusal = [line for line in lines if "NATS cluster" in line]
    assert len(refusal) == 1, "\n".join(lines)
    assert len(lines) <= 12, f"{len(lines)} lines:\n" + "\n".join(lines)
    for text in expected:
        assert text in refusal[0], refusal[0]
    return refusal[0]


def test_an_unreachable_cluster_stops_the_start_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"nats://streamfence:{PASSWORD}@127.0.0.1:{port}"
    proc = DaemonProcess(tmp_path / "state", {}, tables={"cluster": {
        "urls": [url], "host": "host-a", "timeout_s": 2.0}})
    code, lines = _refused_start(proc)
    # "in 2 s": the connect tried for the table's timeout_s (its own test: below)
    line = _assert_one_line(code, lines, f"nats://streamfence:***@127.0.0.1:{port}",
                            "connection refused (", " tries in 2 s)")
    assert PASSWORD not in proc.log_text(), line


def test_each_reason_is_named_within_timeout_s() -> None:
    """A name DNS does not know, a server that accepts and says nothing, and a
    port nothing listens on (the password in its URL hidden)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    port = silent.getsockname()[1]
    cases = [("nats://no-such-host.invalid:4222", "DNS: "),
             (f"nats://127.0.0.1:{port}", "no answer within 1 s"),
             (f"nats://u:{PASSWORD}@127.0.0.1:{free_port()}", "connection refused (")]
    with silent:
        for url, why in cases:
            began = time.monotonic()
            with pytest.raises(Unreachable) as caught:
                asyncio.run(connect(ClusterSettings((url,), "host-a", timeout_s=1.0)))
            assert time.monotonic() - began < 1.5
            assert str(caught.value).startswith(
                f"cannot reach the NATS cluster at {shown_url(url)}: {why}"), str(caught.value)
            assert PASSWORD not in str(caught.value)


# ---- a cluster that requires a password ---------------------------------------------
@pytest.fixture
def nats_pw(tmp_path: Path) -> Iterator[nats_cluster.NatsCluster]:
    cluster = nats_cluster.NatsCluster(tmp_path / "nats", user=USER, password=PASSWORD)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _daemon(tmp_path: Path, emulator: EmulatorProcess | None, urls: list[str],
            password: str) -> DaemonProcess:
    providers = {} if emulator is None else {"emu": profile_for("openai", emulator)}
    return DaemonProcess(tmp_path / "state", providers, env={"SF_TEST_NATS_PW": password},
                         tables={"cluster": {"urls": urls, "host": "host-a", "timeout_s": 3.0,
                                             "auth": {"user": USER,
                                                      "password_env": "SF_TEST_NATS_PW"}}})


@pytest.mark.slow
def test_the_daemon_gives_the_password_the_cluster_requires(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats_pw: nats_cluster.NatsCluster) -> None:
    emu.script("pw", [{"fault": "ok", "chunks": 3, "text": "one two three"}])
    proc = _daemon(tmp_path, emulator, nats_pw.urls, PASSWORD)
    try:
        proc.start()
        with proc.client() as client:
            text = "".join(client.stream_text("emu", {
                "model": "gpt-emu#pw", "messages": [{"role": "user", "content": "hi"}]}))
        assert text == "one two three"
    finally:
        proc.cleanup()
    assert PASSWORD not in proc.log_text()


@pytest.mark.slow
def test_a_wrong_password_stops_the_start_in_one_line(
        tmp_path: Path, nats_pw: nats_cluster.NatsCluster) -> None:
    proc = _daemon(tmp_path, None, nats_pw.urls, "wrong-" + PASSWORD)
    code, lines = _refused_start(proc)
    _assert_one_line(code, lines, nats_pw.urls[0], "authorization refused")
    assert PASSWORD not in proc.log_text()


def test_every_refusal_of_a_password_is_named_as_one(
        nats_pw: nats_cluster.NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes on a refusal; a PING meeting that close resets the
    connection (one try in eight), which must not hide the refusal."""
    monkeypatch.setenv("SF_TEST_NATS_PW", "wrong-" + PASSWORD)
    settings = ClusterSettings(tuple(nats_pw.urls), "host-a", timeout_s=5.0,
                               auth=NatsAuth(user=USER, password_env="SF_TEST_NATS_PW"))
    reasons = []
    for _ in range(24):
        with pytest.raises(Unreachable) as caught:
            asyncio.run(connect(settings))
        reasons.append(str(caught.value).rsplit(": ", 1)[1])
    assert set(reasons) == {"authorization refused (wrong credentials?)"}, reasons


# ---- TLS: a server whose certificate a CA of the test's signed --------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """ca.pem; server.pem for 127.0.0.1 and client.pem, both signed by the CA (keys: *.key)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=streamfence test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """One nats-server on loopback that speaks TLS only and verifies its
    clients' certificates: its URL, and the directory of the certificates."""
    d = tmp_path / "tls"
    d.mkdir()
    _certificates(d)
    port = free_port()
    exe = nats_cluster.executable()
    assert exe is not None, nats_cluster.INSTALL_HINT
    conf = d / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\n"
                    f"tls {{ cert_file: {json.dumps(str(d / 'server.pem'))}, "
                    f"key_file: {json.dumps(str(d / 'server.key'))}, "
                    f"ca_file: {json.dumps(str(d / 'ca.pem'))}, verify: true }}\n")
    with open(d / "nats.log", "wb") as log:
        server = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            assert server.poll() is None, (d / "nats.log").read_text()
            return "Server is ready" in (d / "nats.log").read_text()
        wait_until(listening, 20, "the TLS nats-server to listen")
        yield f"tls://127.0.0.1:{port}", d
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_tls_with_the_ca_and_a_client_certificate_connects(
        tls_server: tuple[str, Path]) -> None:
    url, d = tls_server
    tls = NatsTls(ca=str(d / "ca.pem"), cert=str(d / "client.pem"), key=str(d / "client.key"))

    async def connected(tls: NatsTls) -> bool:
        nc = await connect(ClusterSettings((url,), "host-a", timeout_s=3.0, tls=tls))
        try:
            return bool(nc.is_connected)
        finally:
            await nc.close()

    assert asyncio.run(connected(tls))
    # Without the CA the server's certificate is not trusted: refused at once.
    began = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        asyncio.run(connected(NatsTls(cert=tls.cert, key=tls.key)))
    assert time.monotonic() - began < 3.0
    assert str(caught.value).startswith(f"cannot reach the NATS cluster at {url}: TLS: "), \
        str(caught.value)
    assert "\n" not in str(caught.value)


def test_settings_make_the_context_nats_py_is_given(tmp_path: Path) -> None:
    _certificates(tmp_path)
    tls = NatsTls(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "client.pem"),
                  key=str(tmp_path / "client.key"), verify=False, server_name="nats.internal")
    os.environ.pop("SF_TEST_NATS_PW", None)
    options = client_options(ClusterSettings(("tls://h:1",), "a", tls=tls))
    assert options["tls_hostname"] == "nats.internal"
    assert not options["tls"].check_hostname
    assert options == {"tls": options["tls"], "tls_hostname": "nats.internal"}
