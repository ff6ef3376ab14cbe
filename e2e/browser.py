"""A real browser for the e2e tests: Debian's ``chromium`` driven through ``chromium-driver`` by
Selenium, headless and offline (no sandbox in a container, no background networking, no component
updates, no sync). ``.ci/run`` installs both packages where they are absent; where they still are,
the browser test skips and says which is missing."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser")
DRIVER_NAMES = ("chromedriver", "chromium-driver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--force-device-scale-factor=1")


def _which(names: tuple[str, ...]) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def skip_reason() -> str | None:
    """Why no browser can be driven here, or None."""
    if _which(CHROMIUM_NAMES) is None:
        return "Debian's chromium is not installed (.ci/run installs it)"
    if _which(DRIVER_NAMES) is None:
        return "Debian's chromium-driver (chromedriver) is not installed (.ci/run installs it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra brings it)"
    return None


@contextlib.contextmanager
def browser(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """A headless chromium session, quit afterwards whatever happens."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _which(CHROMIUM_NAMES), _which(DRIVER_NAMES)
    assert chromium and driver_path, skip_reason()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium  # with the driver's path too, Selenium never looks for or fetches either
    for flag in (*FLAGS, f"--window-size={width},{height}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
