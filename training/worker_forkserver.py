"""`python -m training.worker_forkserver FD`: a process that imports the training libraries once and forks a
stage's CPU workers from that state.

Why: a worker started fresh pays ~17 s of CPU on a 2-core host before it trains a step (`import peft` alone is
12 s: it pulls in torch's dynamo, inductor and distributed-tensor modules; `from trl import SFTTrainer,
DPOTrainer, GRPOTrainer` 14 s), so a pipeline with four two-process stages paid it eight times. This server pays it
once per launching process; each worker after that is a `fork()` of it, started in milliseconds. It is a clean
process to fork (one thread, no CUDA, none of the caller's threads or locks), which the caller itself is not.
CUDA stages keep fresh processes (training.launcher): a CUDA context does not survive a fork, and next to a GPU
step the import is small.

It speaks over a SOCK_SEQPACKET socket (one JSON message a packet):
- in: ``{"fork": {module, argv, env, cwd, name}}`` with two file descriptors (the worker's stdout and stderr),
  answered by ``{"pid": P}``: the child runs ``module`` as ``python -m module *argv`` would, in that environment;
  ``{"signal": P, "signum": S}`` to stop a worker it forked (by the server, which knows whether P is still its
  child: no signal reaches a reused pid);
- out: ``{"ready": true}`` once the libraries are imported, ``{"exited": P, "code": C}`` when a worker ends
  (C as ``Popen.returncode`` reads it: negative for a signal).

It dies with the process that started it (the parent-death signal, and the end of the socket), and its workers
with it, so a killed stage leaves no worker training on beside its re-run.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

from artifacts.common.parent_death import die_with_parent, name_process
from training.ranks import PARENT_PID_ENV

MAX_MESSAGE = 1 << 20
# what a worker imports before it trains; imported here once. Not the model or data: those are the job's.
PRELOAD = ("torch", "transformers", "accelerate", "peft", "trl", "training.finetune_stage", "training.sft",
           "training.dpo", "training.grpo", "training.draft", "training.distributed_worker")
# what the stage functions import inside their bodies (the heavy part of a worker's start)
PRELOAD_NAMES = {"trl": ("SFTTrainer", "DPOTrainer", "GRPOTrainer")}


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], fds or [])


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors sent with it; (None, []) when the other end has closed."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
    return (json.loads(data) if data else None), fds


def preload() -> None:
    """Import what every worker needs; a library missing here is the worker's own error to report, not ours."""
    from artifacts.common.quiet import quiet_warnings

    quiet_warnings()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            for attribute in PRELOAD_NAMES.get(name, ()):
                getattr(module, attribute)


def _run_worker(request: dict, fds: list[int], server: int, started: int) -> None:
    """In the forked child: become the worker the request describes, run it, and exit with its status. Writing
    to `started` tells the server the worker is named and bound to its life, before its pid is handed out."""
    code = 1
    try:
        die_with_parent(server)
        name_process(request["name"])
        os.write(started, b"1")
        os.close(started)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # what `python -m MODULE ARGV...` runs; by name, as the command line did (the server knows no worker code)
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1  # as the interpreter
    except BaseException:  # noqa: BLE001 - the worker's last word goes to its log, then its status
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what a normal exit runs (MLflow, torch), as a fresh process would
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket) -> None:
    """Fork a worker per request, report each one's end, and stop (killing any left) when the caller is gone."""
    children: set[int] = set()
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.1)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        message, fds = receive(sock)
        if message is None:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        if "signal" in message:
            if message["signal"] in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(message["signal"], message["signum"])
            continue
        started, child_started = os.pipe()
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(started)
            _run_worker(message["fork"], fds, me, child_started)
        os.close(child_started)
        os.read(started, 1)  # b"" if it died first: its exit is reported like any other
        os.close(started)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send(sock, {"pid": pid})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    die_with_parent(int(os.environ[PARENT_PID_ENV]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers and their launcher, not the server
    preload()
    send(sock, {"ready": True})
    serve(sock)


if __name__ == "__main__":
    main()
