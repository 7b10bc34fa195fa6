"""The shared helpers every package uses: staged directories, sizes, stop tokens, device choice."""

from __future__ import annotations

import json

import pytest
import torch

from artifacts.common.atomic import staged_directory
from artifacts.common.device import pick_device
from artifacts.common.sizes import format_size, parse_size
from artifacts.common.stop_tokens import stop_token_ids
from artifacts.errors import LifecycleError


def _names(path):
    return sorted(p.name for p in path.iterdir())


def test_staged_directory_publishes_replaces_and_cleans_up_after_a_crash(tmp_path):
    out = tmp_path / "gptq"
    with staged_directory(out) as tmp:
        (tmp / "a.safetensors").write_bytes(b"x")
    assert _names(out) == ["a.safetensors"] and out.stat().st_mode & 0o755 == 0o755
    with staged_directory(out) as tmp:
        (tmp / "b.safetensors").write_bytes(b"y")
    assert _names(out) == ["b.safetensors"]
    with pytest.raises(RuntimeError), staged_directory(out) as tmp:
        (tmp / "c.bin").write_bytes(b"z")
        raise RuntimeError("quantizer crashed")
    assert _names(out) == ["b.safetensors"]  # the previous output is untouched
    assert _names(tmp_path) == ["gptq"]  # no staging or old directories left


def test_staged_directory_policies_for_an_existing_target(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "theirs").write_text("1")
    with staged_directory(out, if_exists="keep") as tmp:
        (tmp / "ours").write_text("2")
    assert _names(out) == ["theirs"]
    with pytest.raises(FileExistsError, match="model: appeared"), staged_directory(out, if_exists="fail") as tmp:
        (tmp / "ours").write_text("2")
    assert _names(out) == ["theirs"]
    (out / "adapter").mkdir()
    (out / "adapter" / "old").write_text("x")
    with staged_directory(out, if_exists="merge") as tmp:
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "new").write_text("y")
        (tmp / "model.safetensors").write_text("w")
    assert _names(out) == ["adapter", "model.safetensors", "theirs"]
    assert _names(out / "adapter") == ["new"]
    assert _names(tmp_path) == ["model"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_directory(empty, if_exists="fail") as tmp:  # an empty directory is not a finished output
        (tmp / "x").write_text("1")
    assert _names(empty) == ["x"]


@pytest.mark.parametrize(("text", "expected"), [("5MB", 5_000_000), ("2KiB", 2048), ("512mib", 512 * 2 ** 20),
                                                ("2g", 2 * 10 ** 9), ("1.5GB", 1_500_000_000), ("10", 10),
                                                ("3 TiB", 3 * 2 ** 40), ("7b", 7)])
def test_parse_size_reads_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "5XB", "", "0", "-1MB", "MB"])
def test_parse_size_names_the_setting_it_cannot_read(text):
    with pytest.raises(ValueError, match="^--kv-memory: "):
        parse_size(text, "--kv-memory")


def test_format_size_round_trips():
    for n in (268435456, 3 * 2 ** 30, 1536, 1000):
        assert parse_size(format_size(n)) == n
    assert format_size(268435456) == "256MiB"


class _Tokenizer:
    eos_token_id = 2


def test_stop_tokens_are_generation_config_ids_then_the_tokenizer_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert stop_token_ids(tmp_path, _Tokenizer()) == [7, 2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(tmp_path, _Tokenizer()) == [9, 2]
    (tmp_path / "generation_config.json").unlink()
    assert stop_token_ids(tmp_path, _Tokenizer()) == [2]
    assert stop_token_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(LifecycleError, match="generation_config.json: unreadable eos_token_id"):
        stop_token_ids(tmp_path, _Tokenizer())


def test_pick_device_is_cuda_when_present_else_cpu_and_honours_a_name():
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("auto") == pick_device(None) == pick_device()
    assert pick_device("cpu") == torch.device("cpu")


def test_log_batch_keeps_a_whole_long_curve_drops_unchartable_values_and_cuts_long_params(tmp_path):
    from mlflow.tracking import MlflowClient

    from artifacts.common.mlflow_batch import MAX_PARAM_CHARS, log_batch

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("helpers", artifact_location=str(tmp_path / "art")))
    curve = [("loss", 1.0 / (step + 1), step) for step in range(2500)] + [("loss", float("nan"), 2500)]
    logged = log_batch(run.info.run_id, metrics=curve, params={"recipe": "x" * 7000, "lr": 0.1}, client=client)
    logged += log_batch(run.info.run_id, metrics={"accuracy": 0.5, "missing": None, "inf": float("inf")},
                        step=3, client=client)
    assert logged == 2501
    history = client.get_metric_history(run.info.run_id, "loss")
    assert len(history) == 2500 and max(m.step for m in history) == 2499
    data = client.get_run(run.info.run_id).data
    assert data.metrics == {"loss": 1.0 / 2500, "accuracy": 0.5}
    assert data.params == {"recipe": "x" * MAX_PARAM_CHARS, "lr": "0.1"}


def test_readiness_poll_treats_a_garbled_answer_as_not_ready_and_reports_a_server_that_never_is():
    import socket
    import threading

    from artifacts.common.net import answers_200, free_port, wait_until_ready

    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))

    def garble() -> None:  # a starting server that answers something that is not HTTP
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"GARBAGE\r\n\r\n")

    threading.Thread(target=garble, daemon=True).start()
    url = f"http://127.0.0.1:{port}/health"
    try:
        assert answers_200(url) is False
        assert wait_until_ready(url, timeout=0.3, interval=0.05) == f"{url} did not answer 200 within 0 s"
        assert "exited" in wait_until_ready(url, timeout=5, alive=lambda: False)
    finally:
        listener.close()
