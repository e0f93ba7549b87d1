"""End to end in a browser: `gemrec ui` serves the pipeline's MLflow store; headless Chromium finds the run
with its NE, QPS and MFU, and the registered champion; screenshots go to test-artifacts/."""

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,1100",
]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture(scope="module")
def ui(pipeline_run, gemrec_script):
    """`gemrec ui` on a free port over the pipeline's store; stopped (with its server) at the end."""
    assert pipeline_run["result"].returncode == 0, pipeline_run["result"].stderr[-3000:]
    port = pipeline_run["ui_port"]
    log = open(pipeline_run["work"] / "ui.log", "w")
    process = subprocess.Popen(
        [gemrec_script, "ui", "--port", str(port), "--tracking-uri", pipeline_run["store"]],
        cwd=pipeline_run["work"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, (pipeline_run["work"] / "ui.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "gemrec ui did not come up"
        time.sleep(0.5)
    yield url
    server_processes = descendants(process.pid)
    assert server_processes, "gemrec ui started no MLflow server"
    os.kill(process.pid, signal.SIGTERM)  # gemrec ui stops its MLflow server on SIGTERM
    process.wait(timeout=60)
    log.close()
    deadline = time.monotonic() + 30
    while any(map(alive, server_processes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in server_processes if alive(p)], "the MLflow server outlived gemrec ui"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromium-driver are not installed (make system-deps installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(driver, find, timeout_s: float = 90.0):
    """Poll `find(driver)` until it returns something truthy (the UI renders asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = find(driver)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def close_assistant_panel(driver) -> None:
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()


def metric_row(driver, name: str) -> str | None:
    """Filter the run's metrics table by `name`; the text of the row named exactly `name`."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    search = driver.find_element(By.XPATH, "//input[@placeholder='Search metrics']")
    search.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    search.send_keys(name)
    links = wait_for(driver, lambda d: d.find_elements(By.XPATH, f"//a[normalize-space(text())='{name}']"), 30)
    return links[0].find_element(By.XPATH, "./ancestor::*[@role='row'][1]").text if links else None


def test_run_page_shows_ne_qps_mfu(ui, browser, pipeline_run):
    from gemrec.pipelines import tracking
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    summary = pipeline_run["summary"]
    mlflow_run = tracking.client(pipeline_run["store"]).get_run(summary["run_id"])
    run_name = mlflow_run.info.run_name
    # The experiment's run list (model-training view), then the pipeline's run by its name.
    browser.get(f"{ui}/#/experiments/{mlflow_run.info.experiment_id}/runs?workflowType=machine_learning")
    links = wait_for(browser, lambda d: d.find_elements(By.LINK_TEXT, run_name))
    assert links, f"run {run_name} not in the run list"
    links[0].click()
    assert wait_for(browser, lambda d: "Metrics (" in d.find_element(By.TAG_NAME, "body").text)
    assert summary["run_id"] in browser.current_url
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "dataset_checksum" in text and "git_commit" in text and "gemrec.champion_decision" in text
    close_assistant_panel(browser)
    for key in ("ne", "qps", "mfu"):
        row = metric_row(browser, key)
        assert row is not None, f"metric {key} not on the run page"
        name, value = row.split()
        assert name == key and float(value) == pytest.approx(summary["metrics"][key], rel=1e-6), row
    search = browser.find_element(By.XPATH, "//input[@placeholder='Search metrics']")
    search.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    mfu = wait_for(browser, lambda d: d.find_elements(By.XPATH, "//a[normalize-space(text())='mfu']"))
    browser.execute_script("arguments[0].scrollIntoView({block: 'end'});", mfu[0])
    time.sleep(0.5)
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "mlflow-run.png"))


def test_model_page_shows_the_champion(ui, browser, pipeline_run):
    from selenium.webdriver.common.by import By

    browser.get(f"{ui}/#/models/gemrec-tiny")

    def champion_shown(driver) -> str | None:
        text = driver.find_element(By.TAG_NAME, "body").text
        return text if "champion" in text and "Version 1" in text else None

    text = wait_for(browser, champion_shown)
    assert text, browser.find_element(By.TAG_NAME, "body").text[:3000]
    assert "Champion: version 1" in text  # the registered model's description
    close_assistant_panel(browser)
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "mlflow-model.png"))
