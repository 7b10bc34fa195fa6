"""lm-evaluation-harness against our server, end to end: `lm_eval` (the CLI users run) scores the project's
shipped local tasks through `local-completions` (log-likelihoods via echo + logprobs) and
`local-chat-completions` (greedy chat replies), and every score and every item equals what our in-process
evals compute on the same items with the Hugging Face forward."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evals.generation import generate_replies
from evals.logprobs import completion_logprobs
from evals.model import load_model
from evals.scoring import is_correct
from serving.engine import EngineConfig
from tests.serving.test_api_server import MODEL, running_server

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "evals" / "lm_eval_tasks"
pytestmark = pytest.mark.slow


def _records() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "addition.jsonl").read_text().splitlines() if line.strip()]


def _lm_eval(tmp_path: Path, model: str, model_args: str, task: str, *extra: str) -> tuple[dict, list[dict]]:
    """Run the `lm_eval` CLI from the repository root; return its results and logged samples for ``task``."""
    out = tmp_path / task
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", model, "--model_args", model_args,
                           "--tasks", task, "--include_path", str(TASKS), "--output_path", str(out),
                           "--log_samples", "--batch_size", "1", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results_file,) = out.rglob("results_*.json")
    (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    return json.loads(results_file.read_text())["results"][task], samples


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing whitespace of the context moves to the continuation; encode the whole, cut."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    head = tokenizer.encode(context, add_special_tokens=False)
    return head, whole[len(head):]


def _greedy_matches(lm, context: list[int], continuation: list[int]) -> bool:
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0]
    predicted = logits[len(context) - 1:-1].argmax(-1).tolist()
    return predicted == continuation


@pytest.fixture(scope="module")
def server(micro_base_dir):
    with running_server(micro_base_dir, EngineConfig(num_blocks=256, block_size=8, max_num_seqs=8)) as (base, _):
        yield base


def test_loglikelihood_scores_through_local_completions_equal_ours(server, micro_base_dir, tmp_path):
    args = f"model={MODEL},base_url={server}/v1/completions,tokenizer_backend=huggingface," \
           f"tokenizer={micro_base_dir},num_concurrent=1,max_retries=1"
    results, samples = _lm_eval(tmp_path, "local-completions", args, "lifecycle_addition_loglik")
    records = _records()
    assert len(samples) == len(records)

    lm = load_model(micro_base_dir, "cpu")
    pairs = [_encode_pair(lm.tokenizer, r["prompt"] + "\n", r["reply"]) for r in records]
    ours = completion_logprobs(lm, pairs, batch_size=8)
    theirs = [float(s["resps"][0][0][0]) for s in samples]
    assert theirs == pytest.approx(ours, abs=2e-3)  # item by item
    greedy = [_greedy_matches(lm, c, t) for c, t in pairs]
    assert [str(s["resps"][0][0][1]) == "True" for s in samples] == greedy  # logged as strings
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(ours) / len(ours)), rel=1e-3)
    assert results["acc,none"] == pytest.approx(sum(greedy) / len(greedy))


def test_chat_generation_through_local_chat_completions_equals_our_task_accuracy(server, micro_base_dir, tmp_path):
    args = f"model={MODEL},base_url={server}/v1/chat/completions,num_concurrent=1,max_retries=1"
    results, samples = _lm_eval(tmp_path, "local-chat-completions", args, "lifecycle_addition_chat",
                                "--apply_chat_template")
    records = _records()
    lm = load_model(micro_base_dir, "cpu")
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                add_generation_prompt=True) for r in records]
    replies = [g.text for g in generate_replies(lm, prompts, max_new_tokens=32, batch_size=8)]
    served = [s["resps"][0][0] for s in samples]
    assert served == replies  # the same greedy reply for every item, through HTTP and in process
    ours = sum(is_correct(text, r["answer"]) for text, r in zip(replies, records)) / len(records)
    assert results["exact_match,contract"] == pytest.approx(ours)
