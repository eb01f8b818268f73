"""A real browser for the console's tests and screenshots: Debian's
`chromium` driven by its `chromium-driver` through selenium, headless
(`.ci/run` installs both where missing; a test that needs them fails
without them, never skips). Nothing is downloaded: the driver and the
browser are the system's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
T = TypeVar("T")


def chrome(width: int = 1280, height: int = 900) -> WebDriver:
    """A headless chromium of that window size."""
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars",
                "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def wait(driver: WebDriver, condition: Callable[[WebDriver], T], what: str,
         timeout: float = 20.0) -> T:
    """`condition`'s first truthy value, or a TimeoutException naming `what`."""
    found: T = WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        condition, f"timed out after {timeout:g} s waiting for {what}")
    return found


def log_in(driver: WebDriver, url: str, key: str) -> None:
    """The console's login form, with `key`; then its calls page."""
    driver.delete_all_cookies()
    driver.get(url + "/console/login")
    field = driver.find_element(By.ID, "key")
    field.send_keys(key)
    field.submit()
    wait(driver, lambda d: d.current_url.endswith("/console/calls"), "the calls page")
