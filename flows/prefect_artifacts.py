"""What each lifecycle run shows in the Prefect UI: the eval table, the fidelity table, what each training
stage changed, the rollout, and a link to its MLflow run (Prefect artifacts, keyed per recipe so the UI
keeps their history run after run)."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.report import HEADLINE_METRICS, PipelineReport


def _key(recipe_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"lifecycle-{recipe_name}-{what}".lower())


def mlflow_run_url(tracking_uri: str, run_id: str) -> str:
    """The run's page in the MLflow UI: the tracking server itself, or `lifecycle ui`'s default address."""
    import mlflow

    experiment_id = mlflow.get_run(run_id).info.experiment_id
    base = tracking_uri.rstrip("/") if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def publish_artifacts(recipe_name: str, report: PipelineReport, fidelity_markdown: str, mlflow_run_id: str,
                      tracking_uri: str, rollout: Any = None) -> None:
    rows = [{"model": label, **{m: out.metrics.get(m) for m in HEADLINE_METRICS}}
            for label, out in report.evals.items()]
    create_table_artifact(table=rows, key=_key(recipe_name, "evals"), description="eval suites, every model")
    if fidelity_markdown:
        create_markdown_artifact(markdown=fidelity_markdown, key=_key(recipe_name, "fidelity"),
                                 description="quantization fidelity vs full precision and round-to-nearest")
    changes = [n for n in report.notes if " vs its input " in n]
    if changes:
        create_markdown_artifact(markdown="\n".join(f"- {n}" for n in changes), key=_key(recipe_name, "changes"),
                                 description="what each training stage changed, in points")
    if rollout is not None:
        create_markdown_artifact(markdown=f"**{rollout.result}** (v{rollout.version})\n\n```\n"
                                 + "\n".join(rollout.lines) + "\n```\n", key=_key(recipe_name, "rollout"),
                                 description="the candidate's rollout")
    create_link_artifact(link=mlflow_run_url(tracking_uri, mlflow_run_id), link_text=f"MLflow run {mlflow_run_id}",
                         key=_key(recipe_name, "mlflow"), description="the pipeline run in MLflow")
    create_markdown_artifact(markdown=report.to_markdown(), key=_key(recipe_name, "report"),
                             description=f"lifecycle results for {recipe_name}")
