"""The bundle contract: a frozen, verifiable snapshot of a model that any server can trust.

- `artifacts.writer.write_bundle` / `BundleConfig`: model dir -> bundle (shards, index, tokenizer, manifest).
- `artifacts.verify.verify_bundle`: recompute everything; `BundleVerificationError("<file>: <reason>")`.
- `artifacts.manifest`: the manifest records; `artifacts.shard_plan`: tensor-parallel ownership.
- `artifacts.eval_record`: results beside the bundle, bound to the manifest digest.
- `artifacts.registry`: MLflow model versions and aliases <-> verified local bundle directories.
"""
