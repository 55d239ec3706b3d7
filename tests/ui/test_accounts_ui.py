"""The Ops UI with an account's token: it reads with it and says which account it is."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from tests.conftest import leader_process
from tests.helpers import wait_for
from tests.ui.test_ops_ui import browser, click, console_errors, count  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(240)


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def test_an_accounts_token_reads_and_is_named(procs, nats_server, browser, tmp_path):  # noqa: F811
    started = leader_process(procs, nats_server, tmp_path, SWARM_API_PUBLIC_READS="0")
    leader = next(started)
    created = leader.request("POST", "/api/v1/accounts", json={"name": "vera", "role": "viewer"})
    token = created.json()["token"]
    job_id = leader.submit(stages=1, steps=5)["job_id"]

    browser.get(f"{leader.url}/health")
    browser.execute_script("sessionStorage.setItem('swarm-token', arguments[0])", token)
    browser.get(f"{leader.url}/ops/join-v2")
    label = lambda: browser.find_element(By.CSS_SELECTOR, 'label[for="token"]').text  # noqa: E731
    wait_for(lambda: "account vera (viewer)" in label(), timeout=15, what="the account's name")
    wait_for(lambda: count(browser, f'#jobs tr[data-job="{job_id}"]'), timeout=15, what="the job")
    click(browser, f'#jobs tr[data-job="{job_id}"]')
    wait_for(
        lambda: count(browser, "#job-owner") and text(browser, "#job-owner") == "operator",
        timeout=15,
        what="the job's owner",
    )
    assert [e for e in console_errors(browser) if "favicon.ico" not in e] == []

    # A token the leader does not take says so on the label.
    browser.execute_script("sessionStorage.setItem('swarm-token', 'not-a-token')")
    browser.get(f"{leader.url}/ops/join-v2")
    wait_for(lambda: "not accepted" in label(), timeout=15, what="the refusal on the label")
    started.close()
