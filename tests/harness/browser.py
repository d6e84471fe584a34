"""Debian's headless Chromium for tests, driven by selenium through Debian's
chromium-driver (scripts/setup installs both), and the folder where a test
keeps what a reader looks at afterwards (screenshots)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[webdriver.Chrome]:
    for binary in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(binary), f"{binary} is missing: scripts/setup installs it"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(arg)
    # Debian's driver by path: selenium's own manager would go to the network.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def artifacts(fallback: Path) -> Path:
    """The folder CI keeps ($FLAGELLA_TEST_ARTIFACTS, set by scripts/test),
    else fallback (the test's tmp_path)."""
    folder = Path(os.environ.get("FLAGELLA_TEST_ARTIFACTS") or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
