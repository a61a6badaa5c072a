"""/dashboard in a real headless Chromium (Selenium) against a real `carpool serve` on a ledger, while traffic
runs: the numbers the page renders are the ones /metrics reports. And the Grafana dashboard in docs/ queries
only metrics a live server exports.

A screenshot of the page goes to the test's tmp dir, and to docs/img/dashboard.png with CARPOOL_UPDATE_SCREENSHOT=1.
"""

import json
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from carpool.economics.db import connect
from carpool.economics.keys import ADMIN_SCOPES, create_key

REPO = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOTALS = {
    "total-requests": "carpool:request_success_total",
    "total-prompt-tokens": "carpool:prompt_tokens_total",
    "total-generation-tokens": "carpool:generation_tokens_total",
}
BATCH_LINES = 4


@pytest.fixture(scope="module")
def ledger_live():
    """`carpool serve` on a ledger holding an admin key and a tenant key with a daily budget."""
    home = tempfile.mkdtemp(prefix="carpool-dashboard-")
    conn = connect(os.path.join(home, "carpool.db"))
    _, admin = create_key(conn, "ops", scopes=ADMIN_SCOPES)
    _, tenant = create_key(conn, "acme", budget=1.0, budget_period="day")
    conn.close()
    live = LiveServer("--max-num-seqs", "8", home=home)
    yield live, admin, tenant
    live.stop()
    shutil.rmtree(home, ignore_errors=True)


def metric_totals(url: str) -> dict[str, float]:
    """Each metric name's samples summed over every label set, as /metrics says now."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def served_model(live: LiveServer, key: str) -> str:
    return httpx.get(f"{live.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]


def traffic(live: LiveServer, key: str, stop: threading.Event, failures: list) -> None:
    """Chat in every live tier, two at a time, until told to stop."""
    headers = {"Authorization": f"Bearer {key}"}
    model = served_model(live, key)

    def loop(tiers):
        with httpx.Client(base_url=live.url, headers=headers, timeout=120) as http:
            i = 0
            while not stop.is_set():
                tier = tiers[i % len(tiers)]
                response = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "max_tokens": 24,
                        "ignore_eos": True,
                        "service_tier": tier,
                        "messages": [{"role": "user", "content": f"Count to ten, take {i}."}],
                    },
                )
                if response.status_code != 200:
                    failures.append(response.text)
                i += 1

    workers = [threading.Thread(target=loop, args=(tiers,)) for tiers in (["priority", "default"], ["flex"])]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def submit_batch(live: LiveServer, key: str) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    model = served_model(live, key)
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": f"Line {i}", "max_tokens": 8},
            }
        )
        + "\n"
        for i in range(BATCH_LINES)
    )
    with httpx.Client(base_url=live.url, headers=headers, timeout=60) as http:
        upload = http.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"})
        file_id = upload.json()["id"]
        return http.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        ).json()["id"]


@pytest.fixture
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (`make dev` installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1300"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def refreshes(driver) -> int:
    return int(driver.find_element("tag name", "body").get_attribute("data-refreshes") or 0)


def after_next_refresh(driver, timeout: float = 30) -> None:
    """Wait until a refresh that started after this call has been drawn (two refreshes from now)."""
    target = refreshes(driver) + 2
    deadline = time.monotonic() + timeout
    while refreshes(driver) < target:
        assert time.monotonic() < deadline, driver.find_element("id", "message").text
        time.sleep(0.1)


def shown(driver, element_id: str) -> float:
    text = driver.find_element("id", element_id).text
    return float(re.sub(r"[^0-9.\-]", "", text))


def test_the_page_shows_what_metrics_reports_while_traffic_runs(ledger_live, browser, tmp_path):
    live, admin, tenant = ledger_live
    browser.get(f"{live.url}/dashboard")
    key_form = browser.find_element("id", "key-form")
    deadline = time.monotonic() + 30
    while not key_form.is_displayed():  # no key yet: the data answers 401 and the page asks for one
        assert time.monotonic() < deadline
        time.sleep(0.1)
    browser.find_element("id", "key").send_keys(admin)
    browser.find_element("css selector", "#key-form button").click()
    after_next_refresh(browser)
    assert browser.find_element("id", "state").text == "ready"

    stop, failures = threading.Event(), []
    load = threading.Thread(target=traffic, args=(live, tenant, stop, failures))
    load.start()
    batch_id = submit_batch(live, tenant)
    try:
        moving = []
        for _ in range(4):  # each figure on the page lies between /metrics read just before and just after it
            before = metric_totals(live.url)
            after_next_refresh(browser)
            page = {element_id: shown(browser, element_id) for element_id in TOTALS}
            after = metric_totals(live.url)
            for element_id, name in TOTALS.items():
                assert before[name] <= page[element_id] <= after[name], (element_id, before[name], after[name])
            moving.append(shown(browser, "output-tps"))
        assert max(moving) > 0
        assert page["total-generation-tokens"] > 0
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
    finally:
        stop.set()
        load.join(120)
    assert not failures, failures[:3]

    live.wait_idle()
    deadline = time.monotonic() + 120
    while (
        httpx.get(f"{live.url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {admin}"}).json()["status"]
        != "completed"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    after_next_refresh(browser)
    idle = metric_totals(live.url)
    for element_id, name in TOTALS.items():  # nothing moves now: the page and /metrics agree exactly
        assert shown(browser, element_id) == idle[name], element_id
    assert shown(browser, "kv-usage") == round(100 * idle["carpool:kv_cache_usage_perc"], 1)
    budgets = browser.find_element("id", "budgets").text
    assert "acme" in budgets and "of $1.000000 per day" in budgets
    assert "acme" in browser.find_element("id", "tenant-table").text
    assert f"{BATCH_LINES} done, 0 failed of {BATCH_LINES}" in browser.find_element("id", "batches").text
    if os.environ.get("CARPOOL_UPDATE_SCREENSHOT") == "1":
        shutil.copy(tmp_path / "dashboard.png", REPO / "docs" / "img" / "dashboard.png")


def test_every_metric_the_grafana_dashboard_queries_is_exported(ledger_live):
    live, _, tenant = ledger_live
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {tenant}"}, timeout=60) as http:
        assert (
            http.post(
                "/v1/completions", json={"model": served_model(live, tenant), "prompt": "Hi", "max_tokens": 2}
            ).status_code
            == 200
        )  # a cost sample exists
    exported = set(metric_totals(live.url))
    dashboard = json.loads((REPO / "docs" / "grafana" / "carpool-dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["query"] for variable in dashboard["templating"]["list"]]
    queried = {name for query in queries for name in re.findall(r"carpool:[A-Za-z0-9_:]+", query)}
    assert len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)
