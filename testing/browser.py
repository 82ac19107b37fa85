"""Headless Chromium through its driver, for the playground's browser tests (Debian's chromium and
chromium-driver: `make deps`); a machine without them skips those tests, saying how to get them."""

from __future__ import annotations

import shutil

import pytest


def browser():
    """A fresh headless browser (a new profile: empty localStorage); the caller quits it."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("the browser test needs Debian's chromium and chromium-driver: run `make deps`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=640,960"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def playground(port: int, size: str, seed: str, steps: str):
    """A fresh browser on the playground at ``port``, its model list loaded, with the size, seed
    and steps set; the caller quits it."""
    from selenium.webdriver.support.ui import Select, WebDriverWait

    b = browser()
    try:
        b.get(f"http://127.0.0.1:{port}/")
        WebDriverWait(b, 60).until(lambda b: len(Select(b.find_element("id", "model")).options) > 0)
        Select(b.find_element("id", "size")).select_by_visible_text(size)
        b.find_element("id", "seed").send_keys(seed)
        b.find_element("id", "steps").send_keys(steps)
    except BaseException:
        b.quit()
        raise
    return b
