"""The Ray backend without a cluster: what a replica asks Ray for, the one-line answer when no cluster answers,
and that nothing but a Ray fleet imports Ray. (The cluster tests are in test_ray_fleet.py.)"""

from __future__ import annotations

import subprocess
import sys

from serving.fleet.ray_backend import replica_resources
from tests.serving.fleet_support import REPO, deploy, free_port


def test_a_replica_asks_for_a_gpu_when_it_serves_on_cuda_else_for_its_threads():
    assert replica_resources(["b"], 1, cluster_gpus=0) == ({"num_cpus": 1, "num_gpus": 0}, ["--device", "cpu"])
    assert replica_resources(["b", "--threads", "4"], 4, 0) == ({"num_cpus": 4, "num_gpus": 0}, ["--device", "cpu"])
    assert replica_resources(["b"], None, cluster_gpus=8) == ({"num_cpus": 1, "num_gpus": 1}, ["--device", "cuda"])
    assert replica_resources(["b", "--device", "cuda:0"], 1, 0) == ({"num_cpus": 1, "num_gpus": 1}, [])
    assert replica_resources(["b", "--device=cpu"], 2, cluster_gpus=8) == ({"num_cpus": 2, "num_gpus": 0}, [])


def test_backend_ray_without_a_cluster_is_one_line_and_starts_nothing(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    address = f"127.0.0.1:{free_port()}"
    fleet = tmp_path / "fleet"
    result = deploy("snapshot", str(bundle), "--backend", "ray", "--ray-address", address, "--fleet", str(fleet),
                    "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", home=tmp_path / "home", timeout=120)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: no Ray cluster answers at {address}") and "ray start --head" in line
    assert not fleet.exists() and not (tmp_path / "mlflow.db").exists()


def test_only_a_ray_fleet_imports_ray(tmp_path):
    code = ("import sys; from serving.deploy.cli import build_parser; build_parser(); "
            "from serving.fleet.fleet import Fleet; Fleet(sys.argv[1], 'm', '').connect(); "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "fleet")], cwd=REPO, timeout=120).returncode == 0
