"""`lifecycle serve MODEL_OR_BUNDLE`: the OpenAI-compatible engine server.

`register_cli(subparsers)` is wired into `lifecycle` by flows/cli.py; `python -m serving.cli serve ...`
works standalone. Bad arguments raise ServeError (a LifecycleError) so the CLI prints one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifacts.adapter_bundle import verify_for_serving
from artifacts.common.cli import main_with_subcommands
from artifacts.common.sizes import format_size, parse_size
from artifacts.errors import LifecycleError


class ServeError(LifecycleError):
    """A `serve` argument is wrong or the model cannot be served."""


def kv_memory_bytes(text: str | None) -> int | None:
    """``--kv-memory`` in bytes ('512MiB', '2GB', '1073741824'); None (not given) lets the device size the cache."""
    if text is None:
        return None
    try:
        return parse_size(text, "--kv-memory")
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def engine_config_defaults():
    """``EngineConfig()`` and its dtypes: the flag defaults have one source, as `lifecycle eval`'s come from
    EvalConfig (``serving.engine.config`` imports no torch, so `--help` stays fast)."""
    from serving.engine.config import _DTYPES, CPU_KV_MEMORY_BYTES, EngineConfig

    return EngineConfig(), _DTYPES, CPU_KV_MEMORY_BYTES


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d, dtypes, cpu_kv = engine_config_defaults()
    p.add_argument("model", help="HF model directory or a bundle directory (verified first)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: dir name)")
    p.add_argument("--kv-memory", default=d.kv_memory_bytes,
                   help=f"a fixed KV-cache memory budget, e.g. 512MiB (default: {format_size(cpu_kv)} on CPU; on a "
                        "GPU, what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="on a GPU, the share of its memory this server may use: the KV cache gets what the weights "
                        "and the activations leave of it (default: %(default)s; ignored with --kv-memory or "
                        "--num-blocks, and on CPU)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help="exact number of KV blocks (overrides --kv-memory and --gpu-memory-utilization)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences in the running batch at most (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one engine step (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="waiting requests beyond this get HTTP 429 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length; refused when beyond the model's or the KV cache's (default: the model's, "
                        "up to what the KV cache holds for one sequence)")
    p.add_argument("--no-prefix-caching", action="store_true", default=not d.enable_prefix_caching)
    p.add_argument("--no-chunked-prefill", action="store_true", default=not d.enable_chunked_prefill)
    p.add_argument("--dtype", default=d.dtype, choices=list(dtypes),
                   help="weights, activations and KV cache; auto: bfloat16 on a GPU that has it natively, float16 "
                        "on older GPUs, float32 on CPU (default: %(default)s)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: torch's choice)")
    p.add_argument("--model-impl", default=d.model_impl, choices=["auto", "hf", "compact"],
                   help="forward pass: the compact Llama path when the checkpoint allows it (GPTQ/AWQ "
                        "snapshots are served from their 4-bit codes), or the Hugging Face one (default: %(default)s)")
    p.add_argument("--dequantize", action="store_true", default=d.dequantize,
                   help="serve a GPTQ/AWQ snapshot on the compact path from fp32 copies of its weights instead of "
                        "its 4-bit codes (several times the weight memory, and slower; for comparison)")
    p.add_argument("--speculative-tokens", type=int, default=d.speculative_tokens,
                   help="speculative decoding: tokens guessed per step for greedy requests, from the context "
                        "(n-gram lookup) or by --speculative-model (0 = off; try 4) (default: %(default)s)")
    p.add_argument("--speculative-model", metavar="DIR", default=d.speculative_model,
                   help="a smaller HF model directory with the same tokenizer that guesses the tokens (needs "
                        "--speculative-tokens K); guesses are asked for only where they pay for its passes")
    p.add_argument("--speculative-lookup", action=argparse.BooleanOptionalAction, default=d.speculative_lookup,
                   help="with --speculative-model: take the n-gram lookup's guesses where the context repeats and "
                        "they promise more than the draft's, the draft's elsewhere (default: on; "
                        "--no-speculative-lookup asks the draft alone)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "triton", "torch"],
                   help="attention kernels: auto is Triton's paged kernels on a GPU, the C++ ones for fp32 on CPU, "
                        "torch ops elsewhere; triton or torch forces one (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="run every step eagerly: no CUDA graphs for decode steps on a GPU (for comparison, or "
                        "to save the graphs' memory and capture time)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="keep one engine step in flight: the host applies a step and plans the next while the "
                        "device computes (default: on for a GPU without --speculative-tokens, off on CPU)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="LoRA adapters (PEFT adapter directories) served beside the model: a request's `model` "
                        "names one; loaded before the server is ready")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident at once, mixed in one batch; more may be loaded, the least recently "
                        "used is swapped out (default: 4 with --lora-modules or --admin-key-file, else 0: off)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="largest adapter rank accepted (default: %(default)s)")
    p.add_argument("--admin-key-file", default=None, metavar="FILE",
                   help="a file holding the key for POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(Authorization: Bearer KEY); without it those routes answer 403")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets in-flight requests run; then they are ended and the process exits "
                        "(default: %(default)s)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="step the engine in its own process, so HTTP work never holds up the model "
                        "(default: on; --no-engine-process steps it in a thread of the server process)")
    p.add_argument("--log-level", default="info")


def engine_config_from_args(args: argparse.Namespace):
    from serving.engine import EngineConfig

    draft = args.speculative_model
    if draft is not None and not (Path(draft) / "config.json").is_file():
        raise ServeError(f"--speculative-model: {draft}: not a Hugging Face model directory (config.json missing)")
    try:
        return EngineConfig(block_size=args.block_size, kv_memory_bytes=kv_memory_bytes(args.kv_memory),
                            num_blocks=args.num_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                            enable_chunked_prefill=not args.no_chunked_prefill, dtype=args.dtype,
                            device=args.device, threads=args.threads,
                            model_impl=args.model_impl, dequantize=args.dequantize,
                            speculative_tokens=args.speculative_tokens,
                            speculative_model=args.speculative_model,
                            speculative_lookup=args.speculative_lookup,
                            attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                            async_scheduling=args.async_scheduling,
                            max_loras=max_loras(args), max_lora_rank=args.max_lora_rank)
    except ValueError as e:
        raise ServeError(f"serve: {e}") from e


DEFAULT_MAX_LORAS = 4


def max_loras(args: argparse.Namespace) -> int:
    if args.max_loras is not None:
        return args.max_loras
    return DEFAULT_MAX_LORAS if args.lora_modules or args.admin_key_file else 0


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """``--lora-modules NAME=DIR ...`` as {name: dir}, each checked to be a PEFT adapter directory."""
    modules: dict[str, str] = {}
    for item in args.lora_modules:
        name, eq, directory = item.partition("=")
        if not eq or not name or not directory:
            raise ServeError(f"--lora-modules: {item!r}: expected NAME=DIR")
        if name in modules:
            raise ServeError(f"--lora-modules: {name!r} is named twice")
        if not (Path(directory) / "adapter_config.json").is_file():
            raise ServeError(f"--lora-modules: {name}={directory}: no adapter_config.json (not a PEFT adapter "
                             "directory)")
        try:
            verify_for_serving(directory, args.model)
        except LifecycleError as e:
            raise ServeError(f"--lora-modules: {name}={directory}: {e}") from None
        modules[name] = directory
    if modules and max_loras(args) == 0:
        raise ServeError("--lora-modules: adapters need --max-loras of at least 1")
    return modules


def admin_key(args: argparse.Namespace) -> str | None:
    if args.admin_key_file is None:
        return None
    try:
        key = Path(args.admin_key_file).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ServeError(f"--admin-key-file: {args.admin_key_file}: {e.strerror or e}") from None
    if len(key) < 16:
        raise ServeError(f"--admin-key-file: {args.admin_key_file}: the key must be at least 16 characters")
    return key


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until stopped. Once the server has drained and its engine has stopped, the process ends at once
    (``exit_now``: the interpreter's teardown of a loaded model adds seconds to every stop and restart)."""
    model = Path(args.model)
    if not model.is_dir():
        raise ServeError(f"{model}: not a directory (expected a model or bundle directory)")
    if not (model / "config.json").is_file():
        raise ServeError(f"{model}: config.json missing; not a Hugging Face model or bundle directory")
    if not (0 < args.port < 65536):
        raise ServeError(f"--port: must be in 1..65535, got {args.port}")
    cfg = engine_config_from_args(args)
    modules, key = lora_modules(args), admin_key(args)
    from serving.api.server import run_server

    run_server(model, args.host, args.port, cfg, served_model_name=args.served_model_name,
               drain_timeout_s=args.drain_timeout, log_level=args.log_level, engine_process=args.engine_process,
               lora_modules=modules, admin_key=key)
    from artifacts.common.fast_exit import exit_now

    exit_now(0)


def register_cli(subparsers) -> None:
    """Add `serve` to the `lifecycle` CLI."""
    p = subparsers.add_parser("serve", help="serve a model or bundle over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    return main_with_subcommands("serving", register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
