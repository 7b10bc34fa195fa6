"""`deploy`: put verified snapshots in front of traffic, and steer the rollout by hand.

    deploy snapshot SOURCE [--as shadow|canary|champion]   into the local fleet (gateway + one replica per snapshot)
    deploy status                                          variants, versions, weights, step, gate values, decisions
    deploy promote | rollback | pause | resume            ask the rollout controller, as the MLflow UI tag does
    deploy stop                                            stop the local fleet

SOURCE is a bundle directory or a registry URI (`models:/name@alias`, `models:/name/3`); it is resolved to
a local directory and verified in full before anything serves it. The first snapshot of a model becomes
champion after a smoke check; later ones go through a rollout (shadow with a noise floor, canary steps,
gates) run by the controller in the background (`lifecycle rollout run DIR`, a Prefect flow).
`--standalone` serves one snapshot in the foreground without the fleet, as before.

The verbs live in ``snapshot.py`` (with ``standalone.py``), ``status.py`` and ``control.py``; the parser and
``main`` (the console script's entry point) in ``cli.py``.
"""

from __future__ import annotations

from serving.deploy.cli import build_parser, main
from serving.deploy.snapshot import replica_serve_flags

__all__ = ["build_parser", "main", "replica_serve_flags"]
