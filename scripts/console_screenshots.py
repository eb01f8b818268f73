"""`python -m scripts.console_screenshots [--out docs]`: the README's
screenshots of the console (docs/console-calls.png, docs/console-call.png,
docs/console-daemon.png), taken in a headless chromium (tests/browser.py:
the test extra, Debian's chromium and chromium-driver) from a daemon and
emulator started here, with a few calls of each kind: completed, a zombie
killed and retried, a provider error, one cancelled, two running.
`--narrow` adds phone-width shots (not committed) to check the layout.
"""

from __future__ import annotations

import argparse
import base64
import tempfile
from pathlib import Path

from selenium.webdriver.remote.webdriver import WebDriver

from streamfence.devtools.emulator.control import (
    EmulatorClient,
    EmulatorProcess,
    emulator_profile,
)
from streamfence.devtools.launcher import DaemonProcess, wait_until
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import Client
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.keys import KeyStore
from tests.browser import chrome, log_in, wait
from tests.harness import free_port, healthy

ANSWERS = ("Invoice 4711 is paid in full; the customer asked for a copy by e-mail.",
           "Invoice 4712 is overdue by 12 days; a reminder went out on Monday.",
           "Invoice 4713 was disputed: two line items are billed twice.")
ZOMBIE = ("The incident began at 09:12 when the primary database",
          "1. The primary database ran out of disk at 09:12.\n2. Writes failed for 14 "
          "minutes.\n3. A larger volume was attached and the backlog replayed.")
QUESTION = [{"role": "user", "content": "Summarize the incident report in three lines."}]


def _request(key: str) -> dict[str, object]:
    return {"model": f"gpt-4o-mini#{key}", "messages": QUESTION, "max_tokens": 400}


def _calls(daemon: DaemonProcess, emu: EmulatorClient) -> str:
    """Runs the calls the shots show; returns the zombie's id."""
    keys = KeyStore(daemon.state_dir / "keys")
    emu.script("zombie", [{"fault": "stall", "after": 4, "stall_s": 3.0, "text": ZOMBIE[0]},
                          {"fault": "ok", "text": ZOMBIE[1]}])
    for i, text in enumerate(ANSWERS):
        emu.script(f"ok-{i}", [{"fault": "ok", "text": text}])
    emu.script("refused", [{"fault": "status", "status": 400, "message": "max_tokens too large"}])
    emu.script("cancel", [{"fault": "stall", "after": 2, "stall_s": 60.0}])
    for key in ("slow-1", "slow-2"):
        emu.script(key, [{"fault": "ok", "chunks": 400, "chunk_delay_s": 0.2}])
    with Client(daemon.endpoint, credentials=keys.register("billing-app", daemon.endpoint)) as app, \
            Client(daemon.endpoint, credentials=keys.register("support-bot", daemon.endpoint)) as bot:
        for i in range(3):
            app.run("emu", _request(f"ok-{i}"), session_id=f"invoice-{4711 + i}")
        zombie = bot.submit("emu", _request("zombie"), session_id="ticket-982",
                            options={"stale_timeout_s": 1.0, "on_partial": "restart"})
        for _ in bot.events(zombie):
            pass
        bot.run("emu", _request("refused"), session_id="ticket-983")
        cancelled = app.submit("emu", _request("cancel"), subscribe=False)
        emu.wait_for(lambda log: bool(log and log[0]["chunks_sent"] >= 2), timeout=10.0,
                     what="the call to cancel to start", key="cancel")
        app.cancel(cancelled)
        assert app.result(cancelled, wait_s=10.0) is not None
        app.submit("emu", _request("slow-1"), session_id="invoice-4720", subscribe=False)
        bot.submit("emu", _request("slow-2"), session_id="ticket-990", subscribe=False)
    return zombie


def _shoot(driver: WebDriver, url: str, path: Path, ready: str, width: int,
           max_height: int = 1400) -> None:
    """The page, once `ready` (a script's truthy answer) and live, whole down to
    `max_height` CSS pixels (chromium's own capture beyond the viewport)."""
    driver.get(url)
    wait(driver, lambda d: d.execute_script(ready), f"{url} to be ready")
    wait(driver, lambda d: d.execute_script(  # live, or a finished call's stream ended
        "var n = document.getElementById('ended');"
        "return document.body.classList.contains('is-live') || !!(n && n.textContent);"),
        "the live stream")
    height = min(int(driver.execute_script("return document.documentElement.scrollHeight")),
                 max_height)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.console_screenshots", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("docs"))
    p.add_argument("--narrow", action="store_true", help="also phone-width shots, into /tmp")
    args = p.parse_args(argv)
    with EmulatorProcess() as emulator, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        daemon = DaemonProcess(
            Path(tmp) / "state",
            {"emu": dict(emulator_profile("openai", emulator.base_url), stale_timeout_s=20.0)},
            tables={"http": {"listen": f"127.0.0.1:{port}"}})
        daemon.start()
        url = f"http://127.0.0.1:{port}"
        driver = chrome(1200, 800)
        try:
            wait_until(lambda: healthy(url), 30.0, "the gateway")
            zombie = _calls(daemon, emulator.client())
            log_in(driver, url, http_key(load_credentials(daemon.credentials_path)))
            shots = [(f"{url}/console/calls", "console-calls.png",
                      "return document.querySelectorAll('tr[data-call]').length >= 8"),
                     (f"{url}/console/calls/{zombie}", "console-call.png",
                      "return document.getElementById('ended').textContent.length > 0"),
                     (f"{url}/console/daemon", "console-daemon.png",
                      "return !!document.getElementById('daemon')")]
            for page, name, ready in shots:
                _shoot(driver, page, args.out / name, ready, 1200)
            if args.narrow:
                driver.set_window_size(420, 900)
                for page, name, ready in shots:
                    _shoot(driver, page, Path(tempfile.gettempdir()) / f"narrow-{name}", ready,
                           420)
        finally:
            driver.quit()
            daemon.cleanup()


if __name__ == "__main__":
    main()
