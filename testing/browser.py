"""Headless Chromium for the playground's browser tests (Debian's chromium and chromium-driver)."""

from __future__ import annotations

import shutil

import pytest


def headless_chromium():
    """A Selenium driver of headless Chromium; the test is skipped where the browser is missing."""
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
