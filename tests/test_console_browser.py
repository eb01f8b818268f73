"""Issue 34, item 1: the console at /console, in a real browser (headless
Debian chromium through selenium: tests/browser.py), against a real daemon
and its gateway. A viewer logs in with a key, sees a call appear and
progress live, opens a zombie call and finds its two attempts with the
stale kill between them, cancels a running call from the page (the
emulator's record shows the provider connection closed), and a client key
cannot see another identity's call. Call text is shown as text. Over plain
HTTP: one identity's live pages are capped.

One daemon and one browser serve the module; every wait is on a page or
log condition, with a timeout.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from streamfence.devtools.emulator.control import (
    EmulatorClient,
    EmulatorProcess,
    emulator_profile,
)
from streamfence.gateway.console import MAX_LIVE_PAGES
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import Client
from streamfence.protocol.credentials import Credentials, load_credentials
from streamfence.protocol.keys import KeyStore
from tests.browser import chrome, log_in, wait
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.wires import request_for

pytestmark = pytest.mark.slow


@dataclass
class Site:
    daemon: DaemonProcess
    url: str
    admin_key: str
    alice: Credentials
    bob: Credentials


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory,
         emulator: EmulatorProcess) -> Iterator[Site]:
    port = free_port()
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("console")) / "state",
        {"emu": dict(emulator_profile("openai", emulator.base_url), stale_timeout_s=20.0)},
        daemon={"backoff_base_s": 0.05, "backoff_max_s": 0.2},
        tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        keys = KeyStore(daemon.state_dir / "keys")
        yield Site(daemon, url, http_key(load_credentials(daemon.credentials_path)),
                   keys.register("alice", daemon.endpoint), keys.register("bob", daemon.endpoint))
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def admin(site: Site, browser: WebDriver) -> WebDriver:
    """The browser, logged in with the admin's key, on the calls page."""
    log_in(browser, site.url, site.admin_key)
    return browser


# Read in one script: the live updates replace these elements under selenium's feet.
def _row_state(driver: WebDriver, call_id: str) -> str | None:
    state: str | None = driver.execute_script(
        "var r = document.querySelector('tr[data-call=\"' + arguments[0] + '\"]');"
        "return r ? r.dataset.state : null;", call_id)
    return state


def _text(driver: WebDriver, css: str) -> str:
    text: str = driver.execute_script(
        "var e = document.querySelector(arguments[0]); return e ? e.innerText : '';", css)
    return text


def _calls_listed(driver: WebDriver) -> list[str]:
    calls: list[str] = driver.execute_script(
        "return Array.from(document.querySelectorAll('tr[data-call]'), r => r.dataset.call);")
    return calls


def test_a_call_appears_and_progresses_live(site: Site, admin: WebDriver,
                                            emu: EmulatorClient) -> None:
    emu.script("live", [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.1}])  # 3 s of text
    admin.execute_script("window.notReloaded = true")
    with site.daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "live"), session_id="live-s1")
        # Seen running, then completed, by the live updates of the page loaded before.
        wait(admin, lambda d: _row_state(d, call_id) in ("running", "authorizing"),
             "the call's row to appear, running")
        wait(admin, lambda d: _row_state(d, call_id) == "completed",
             "the call's row to turn completed")
        for _ in client.events(call_id):
            pass
    assert admin.execute_script("return window.notReloaded") is True
    row = _text(admin, f'tr[data-call="{call_id}"]')
    assert "live-s1" in row and "chars" in row
    # A search by the session id's prefix finds it alone.
    admin.get(site.url + "/console/calls?search=live-s")
    assert _calls_listed(admin) == [call_id]


def test_a_zombie_call_shows_two_attempts_with_the_stale_kill(
        site: Site, admin: WebDriver, emu: EmulatorClient) -> None:
    emu.script("zombie", [{"fault": "stall", "after": 3, "stall_s": 3.0}])
    with site.daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "zombie"),
                                options={"stale_timeout_s": 1.0, "on_partial": "restart"})
        events = list(client.events(call_id))
    assert events[-1]["status"] == "completed" and events[-1]["attempts"] == 2
    admin.get(f"{site.url}/console/calls/{call_id}")
    wait(admin, lambda d: "completed" in _text(d, "#ended"), "the transcript's done")
    attempts = admin.find_elements(By.CSS_SELECTOR, "#attempts li.attempt")
    assert [a.get_attribute("data-how") for a in attempts] == ["stale", "ended"]
    assert "stale kill" in attempts[0].text and "worker pid" in attempts[0].text
    gap = admin.find_element(By.CSS_SELECTOR, "#attempts li.gap")
    assert "back-off" in gap.text
    # The transcript as the subscriber saw it: attempt 1's text, the reset, attempt 2's.
    parts = admin.find_elements(By.CSS_SELECTOR, "#transcript .part")
    assert [p.get_attribute("data-attempt") for p in parts] == ["1", "2"]
    assert "voided" in (parts[0].get_attribute("class") or "")
    assert "reset" in _text(admin, "#transcript .reset")
    second = "".join(e["data"] for e in events if e["op"] == "delta" and e["attempt"] == 2)
    assert parts[1].text.endswith(second)
    assert not admin.find_elements(By.ID, "cancel")  # an ended call has no cancel button


def test_cancel_a_running_call_from_the_page(site: Site, admin: WebDriver,
                                             emu: EmulatorClient) -> None:
    emu.script("cancel-me", [{"fault": "stall", "after": 2, "stall_s": 30.0}])
    with site.daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "cancel-me"), subscribe=False)
        emu.wait_for(lambda log: bool(log and log[0]["chunks_sent"] >= 2), timeout=10.0,
                     what="the provider's first chunks", key="cancel-me")
        admin.get(f"{site.url}/console/calls/{call_id}")
        button = wait(admin, lambda d: d.find_elements(By.CSS_SELECTOR, "#cancel button"),
                      "the cancel button")[0]
        clicked = time.time()
        button.click()
        wait(admin, lambda d: "cancelled" in _text(d, "#ended"), "the call to end cancelled")
        assert "cancelled" in _text(admin, "#call-state")
        done = client.result(call_id, wait_s=10.0)
    assert done is not None and done["status"] == "cancelled"
    record = emu.wait_for(lambda log: log[0] if log and log[0]["aborted"] else None,
                          timeout=10.0, what="the provider connection to close",
                          key="cancel-me")
    assert not record["completed"] and record["ended"] >= clicked, record


def test_call_text_is_shown_as_text(site: Site, admin: WebDriver,
                                    emu: EmulatorClient) -> None:
    hostile = "<script>window.pwned = 1</script><b id=bold>bold</b> & <i>more</i>"
    emu.script("hostile", [{"fault": "ok", "text": hostile, "chunks": 5}])
    with site.daemon.client() as client:
        call_id = client.run("emu", request_for("openai", "hostile"),
                             session_id="<img src=x onerror='window.pwned=2'>")["call_id"]
    admin.get(f"{site.url}/console/calls/{call_id}")
    wait(admin, lambda d: "completed" in _text(d, "#ended"), "the transcript's done")
    assert hostile in _text(admin, "#transcript")
    assert not admin.find_elements(By.CSS_SELECTOR, "#transcript b, #transcript script, img")
    assert admin.execute_script("return window.pwned") is None
    admin.get(site.url + "/console/calls")
    assert "<img src=x" in _text(admin, f'tr[data-call="{call_id}"]')
    assert admin.execute_script("return window.pwned") is None


def test_a_client_key_cannot_see_another_identitys_call(site: Site,
                                                       browser: WebDriver) -> None:
    with Client(site.daemon.endpoint, credentials=site.alice) as alice, \
            Client(site.daemon.endpoint, credentials=site.bob) as bob:
        mine = alice.run("emu", request_for("openai", "alice"))["call_id"]
        theirs = bob.run("emu", request_for("openai", "bob"))["call_id"]
    log_in(browser, site.url, http_key(site.alice))
    wait(browser, lambda d: _row_state(d, mine) == "completed", "alice's own call")
    assert _calls_listed(browser) == [mine]
    browser.get(f"{site.url}/console/calls?identity=bob")
    assert _calls_listed(browser) == []
    browser.get(f"{site.url}/console/calls/{theirs}")
    assert "No such call" in browser.find_element(By.TAG_NAME, "h1").text
    browser.get(f"{site.url}/console/daemon")
    assert "client" in _text(browser, "#daemon") and "Workers" not in _text(browser, "#daemon")


def test_without_a_key_the_console_asks_for_one(site: Site) -> None:
    """No browser needed: the login form, a wrong key refused, the stream closed."""
    with urllib.request.urlopen(site.url + "/console/calls") as reply:  # redirected
        assert reply.url.endswith("/console/login") and b'name=key' in reply.read()
    wrong = urllib.request.Request(site.url + "/console/login", data=b"key=sf-local.00",
                                   method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(wrong)
    refused.value.close()
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as closed:
        urllib.request.urlopen(site.url + "/console/calls/events")
    closed.value.close()
    assert closed.value.code == 401


@pytest.mark.parametrize("width", [412, 660])  # a phone; 80 characters of a terminal's font
def test_the_pages_fit_a_narrow_window(site: Site, admin: WebDriver, width: int) -> None:
    with site.daemon.client() as client:
        call_id = client.run("emu", request_for("openai", "narrow"),
                             session_id="a-session-id-of-some-length-0123456789")["call_id"]
    admin.set_window_size(width, 900)
    try:
        for page in ("/console/calls", f"/console/calls/{call_id}", "/console/daemon"):
            admin.get(site.url + page)
            wait(admin, lambda d: d.find_elements(By.CSS_SELECTOR, "body.is-live, #ended"),
                 f"{page} to load")
            overflow = admin.execute_script(
                "return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{page} is {overflow} px wider than a {width} px window"
        admin.get(site.url + "/console/calls")
        table = admin.execute_script(  # the list's table too, not only the page around it
            "var s = document.querySelector('.scroll'); return s.scrollWidth - s.clientWidth")
        assert table <= 0, f"the calls table is {table} px wider than a {width} px window"
    finally:
        admin.set_window_size(1280, 900)


def _open_stream(url: str, key: str) -> Any:
    request = urllib.request.Request(url + "/console/calls/events",
                                     headers={"Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(request, timeout=10)


def test_one_identity_holds_at_most_its_share_of_live_pages(site: Site) -> None:
    """Each live page is a poll (a transcript, a connection of its own to the
    daemon): an identity past MAX_LIVE_PAGES is refused 429, counted, and the
    others are not; a page closed makes room again."""
    alice, bob = http_key(site.alice), http_key(site.bob)
    held = [_open_stream(site.url, alice) for _ in range(MAX_LIVE_PAGES)]
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            _open_stream(site.url, alice)
        body = refused.value.read().decode()
        refused.value.close()
        assert refused.value.code == 429 and "too_many_live_pages" in body, body
        _open_stream(site.url, bob).close()  # another identity's share is its own
        held.pop().close()

        def reopened() -> Any:
            try:
                return _open_stream(site.url, alice)
            except urllib.error.HTTPError as exc:
                exc.close()
                return None
        held.append(wait_until(reopened, 10.0, "a page of alice's again once one closed"))
        with urllib.request.urlopen(site.url + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        assert 'streamfence_gateway_refused_total{code="too_many_live_pages"}' in metrics
    finally:
        for stream in held:
            stream.close()
