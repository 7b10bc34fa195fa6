"""The MLflow UI, opened in real headless chromium, shows a registered model's aliases and version tags.

This proves `tests/browser.py` end to end (real `mlflow server` subprocess + system chromium via Playwright)
and is the template for UI checks: build a real store with the client, then read what the UI renders.
"""

from __future__ import annotations

import importlib.util

import pytest
from browser import chromium_path, headless_page, mlflow_ui_server, page_text, save_screenshot, squash_whitespace

MODEL = "browser-demo"
EXPERIMENT = "browser-demo-experiment"
ROLLOUT_TAG = ("rollout.state", "canary 25%")

pytestmark = [
    pytest.mark.skipif(chromium_path() is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None, reason="playwright is not installed (pip install playwright)"
    ),
]


@pytest.fixture
def demo_store(tmp_path, monkeypatch) -> str:
    """A fresh sqlite store: one experiment with a run, and MODEL with two versions, two aliases and a tag."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # nothing MLflow writes by default (./mlruns) may land in the repo
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment_id = client.create_experiment(EXPERIMENT, artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment_id, run_name="browser-demo-run")
    client.set_terminated(run.info.run_id)

    client.create_registered_model(MODEL, description="Registered by tests/test_browser_support.py")
    for n in (1, 2):
        weights = tmp_path / f"model-v{n}"
        weights.mkdir()
        (weights / "MLmodel").write_text(f"version: {n}\n", encoding="utf-8")
        version = client.create_model_version(MODEL, source=weights.as_uri(), run_id=run.info.run_id)
        assert str(version.version) == str(n)  # the sqlite store returns an int, REST a string
    client.set_registered_model_alias(MODEL, "champion", "1")
    client.set_registered_model_alias(MODEL, "canary", "2")
    client.set_model_version_tag(MODEL, "2", *ROLLOUT_TAG)
    return uri


def test_mlflow_ui_shows_aliases_tags_and_experiments(demo_store: str, tmp_path) -> None:
    with mlflow_ui_server(demo_store) as base_url, headless_page() as page:
        text = page_text(page, f"{base_url}/#/models/{MODEL}", wait_for_text=ROLLOUT_TAG[1], timeout_s=90)
        shot = save_screenshot(page, tmp_path / "model-page.png")
        flat = squash_whitespace(text)
        assert MODEL in flat
        # MLflow renders an alias as a chip "@<no-break space>name"; the tag as "key" then ": value".
        assert "@ champion" in flat and "@ canary" in flat, flat
        assert f"{ROLLOUT_TAG[0]} : {ROLLOUT_TAG[1]}" in flat, flat

        # Each alias and the tag sit in their own version's row of the versions table (ARIA role "row").
        def row(version: int) -> str:
            link = page.get_by_role("link", name=f"Version {version}", exact=True)
            return squash_whitespace(page.get_by_role("row").filter(has=link).inner_text())

        assert "@ champion" in row(1) and "@ canary" not in row(1) and ROLLOUT_TAG[1] not in row(1)
        assert "@ canary" in row(2) and ROLLOUT_TAG[1] in row(2) and "@ champion" not in row(2)
        assert shot.stat().st_size > 10_000  # a real rendering, not a blank page

        experiments = page_text(page, f"{base_url}/#/experiments", wait_for_text=EXPERIMENT, timeout_s=90)
        assert EXPERIMENT in experiments
        save_screenshot(page, tmp_path / "experiments.png")
