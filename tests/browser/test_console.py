"""The web console in a real browser, served by a live dispatcher.

A headless Chromium (Debian's chromium and chromium-driver; selenium never
downloads anything) logs in, watches the overview's live table count a failed
message, finds it on its stage page (next to the stage's workers, which only a
console served by the dispatcher knows), retries it in two steps and sees it
finish. With PEPSI_SCREENSHOTS=1 it saves the three main pages to docs/images/
(docs/web.md shows them); otherwise it writes nothing into the repository.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pepsi import Message, PermanentError, stage
from pepsi.amqp.auth.passwords import hash_password
from tests.scenarios.conftest import REPO, Pipeline, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
IMAGES = REPO / "docs" / "images"
PASSWORD = "pw"
GATE = "PEPSI_TEST_GATE"
WAIT = 20.0  # seconds any one thing the browser waits for may take


@stage()
def gate(msg: Message) -> None:
    """A poisoned message fails for good while the file named by $PEPSI_TEST_GATE exists."""
    if msg.properties.get("poison") and Path(os.environ[GATE]).exists():
        raise PermanentError("the upstream record is missing")


def stages_text(port: int) -> str:
    """Four stages: ingest -> enrich -> deliver, and a slow `report` with a backlog."""
    return (
        "[stage-ingest]\nHANDLER = tests.stages:noop\nNEXT = enrich\n"
        "[stage-enrich]\nHANDLER = tests.browser.test_console:gate\nNEXT = deliver\n"
        "[stage-deliver]\nHANDLER = tests.stages:noop\n"
        "[stage-report]\nHANDLER = tests.stages:slow\nPARALLELISM = 1\nQUEUE_LIMIT = 1\n"
        f"[pepsi-web]\nLISTEN = 127.0.0.1:{port}\n"
        f"PASSWORD = {hash_password(PASSWORD, log2_n=10)}\n"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pipeline(dsn: str, tmp_path: Path) -> Iterator[Pipeline]:
    """The scenario harness (tests/scenarios/conftest.py): a real dispatcher process."""
    p = Pipeline(dsn, tmp_path)
    yield p
    p.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip(
            "chromium and chromium-driver are not installed (scripts/dev.py installs them as root)"
        )
    from selenium import webdriver  # noqa: PLC0415  # workers import this module too
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    # a path for the driver: selenium skips its manager, which would download one
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def status(pipeline: Pipeline, wid: int) -> str | None:
    row = pipeline.row(wid)
    return None if row is None else row[1]


def screenshot(driver: Any, name: str) -> None:
    """The whole page to docs/images/NAME, only when PEPSI_SCREENSHOTS=1."""
    if os.environ.get("PEPSI_SCREENSHOTS") != "1":
        return
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1280, max(1000, min(height + 140, 4000)))
    IMAGES.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(IMAGES / name))
    driver.set_window_size(1280, 1000)


@pytest.mark.browser
def test_console_in_a_browser(pipeline: Pipeline, browser: Any, tmp_path: Path) -> None:
    from selenium.common.exceptions import (  # noqa: PLC0415
        NoSuchElementException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support import expected_conditions as ec  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    driver = browser
    # the live refresh replaces the overview's elements every 2 s: one found just
    # before may be stale when read, and is looked up again at the next poll
    wait = WebDriverWait(
        driver, WAIT, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
    )

    def text_of(element_id: str) -> str:
        return str(wait.until(lambda d: d.find_element(By.ID, element_id).text))

    def shows(element_id: str, wanted: str) -> Any:
        return lambda d: d.find_element(By.ID, element_id).text == wanted

    gate_file = tmp_path / "gate"
    gate_file.touch()
    pipeline.extra_env[GATE] = str(gate_file)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pipeline.configure(stages_text(port), WORKER_IDLE_TIMEOUT="5m", STATS_INTERVAL="2s")
    dispatcher = pipeline.start()
    wait_until(lambda: "web console at" in dispatcher.log, what="the console to listen")

    # a page needs a login; the form posts with the browser's own Origin
    driver.get(f"{base}/")
    wait.until(ec.url_contains("/login"))
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "form.login button[type=submit]").click()
    wait.until(ec.presence_of_element_located((By.ID, "stage-table")))
    assert driver.current_url == f"{base}/"
    assert text_of("failed-enrich") == "0"
    assert text_of("pending-report") == "0"

    # published after the page loaded: only the live refresh can show them
    pipeline.publish("report", count=40, sender="reports@example.com", properties={"sleep": 0.5})
    pipeline.publish("ingest", count=25, sender="shop@example.com", subject="order")
    (poisoned,) = pipeline.publish(
        "ingest",
        body=b'{"order": 1042, "customer": "c-77", "items": 3}',
        content_type="application/json",
        sender="shop@example.com",
        subject="order 1042",
        properties={"poison": True},
    )
    wait.until(lambda d: int(d.find_element(By.ID, "pending-report").text) > 0)
    wait.until(shows("failed-enrich", "1"))
    wait.until(lambda d: d.find_element(By.ID, "rate-processed-ingest").text != "–")
    # the chart counts what the dispatcher's statistics say (every 2 s here)
    wait.until(lambda d: d.find_element(By.ID, "chart-processed").text not in ("", "0"))
    assert "dispatcher" in text_of("overview-meta")
    assert text_of("dispatcher-state").startswith("running (its database session: pid ")
    screenshot(driver, "web-overview.png")

    # the stage page lists the failed message, and the stage's workers
    driver.find_element(By.CSS_SELECTOR, "#stage-row-enrich a").click()
    wait.until(ec.url_contains("/stage/enrich"))
    workers = wait.until(ec.presence_of_element_located((By.ID, "workers")))
    assert "ready" in workers.text or "starting" in workers.text
    driver.get(f"{base}/stage/enrich?status=failed")
    links = driver.find_elements(By.CSS_SELECTOR, "#messages a[href^='/message/']")
    assert [a.text for a in links] == [str(poisoned)]
    assert status(pipeline, poisoned) == "failed"
    driver.get(f"{base}/stage/report?limit=12")
    assert wait.until(ec.presence_of_element_located((By.ID, "workers"))).text
    assert driver.find_elements(By.CSS_SELECTOR, "#messages a[href^='/message/']")
    screenshot(driver, "web-stage.png")

    # the message: failed, and why
    driver.get(f"{base}/stage/enrich?status=failed")
    driver.find_element(By.CSS_SELECTOR, "#messages a[href^='/message/']").click()
    wait.until(ec.url_contains(f"/message/{poisoned}"))
    assert text_of("status") == "failed"
    assert "upstream record is missing" in text_of("last-error")
    screenshot(driver, "web-message.png")

    # retry, in two steps: the confirmation names the count, then it runs
    gate_file.unlink()
    driver.find_element(By.ID, "retry").click()
    count = wait.until(ec.presence_of_element_located((By.ID, "count")))
    assert count.get_attribute("data-count") == "1"
    assert status(pipeline, poisoned) == "failed"  # nothing done yet
    driver.find_element(By.ID, "confirm").click()
    wait.until(ec.url_contains("done=retry"))

    def gone(d: Any) -> bool:
        d.get(f"{base}/message/{poisoned}")
        return bool(d.find_elements(By.ID, "missing"))

    wait.until(gone)
    assert pipeline.row(poisoned) is None
    wait_until(
        lambda: "web: retry of 1 message(s) by admin" in dispatcher.log,
        what="the repair in the dispatcher's log",
    )

    # back on the overview, the failed count falls to 0 again
    driver.get(f"{base}/")
    wait.until(shows("failed-enrich", "0"))
