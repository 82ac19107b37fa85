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
