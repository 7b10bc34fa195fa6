"""A quick greedy check of a model dir on held-out task problems (not the official eval suite).

Why here: tuning the embedded base recipe needs a number in seconds (does the model already answer in
the ``Answer: X`` format, and how often is it right?) without the evals package. Run as
``python -m training.greedy_accuracy MODEL_DIR --task addition --n 200``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from training.tasks import check_answer, contract_answer, generate_examples


@dataclass
class GreedyAccuracy:
    task: str
    n: int
    accuracy: float  # replies with the right answer
    format_rate: float  # replies that keep the contract (`training.tasks.contract_answer`) and stopped on eos
    samples: list[dict[str, str]]


def greedy_accuracy(model_dir: Path | str, task: str = "addition", n: int = 200, seed: int = 0,
                    batch_size: int = 50, max_new_tokens: int = 48) -> GreedyAccuracy:
    """Greedy-decode ``n`` held-out problems in left-padded batches and score the replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model_greedy_accuracy(model, tokenizer, task, n, seed, batch_size, max_new_tokens)


def model_greedy_accuracy(model, tokenizer, task: str = "addition", n: int = 200, seed: int = 0,
                          batch_size: int = 50, max_new_tokens: int = 48) -> GreedyAccuracy:
    """`greedy_accuracy` of a model already in memory (used mid-training by recipe-tuning scripts)."""
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    examples = generate_examples(task, "heldout", n, seed)
    correct = formatted = 0
    samples = []
    for start in range(0, n, batch_size):
        batch = examples[start:start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                               add_generation_prompt=True) for ex in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        for ex, row in zip(batch, out[:, inputs["input_ids"].shape[1]:].tolist(), strict=True):
            stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
            reply = tokenizer.decode(row[:stop] if stop is not None else row, skip_special_tokens=True)
            ok = check_answer(ex, reply)
            correct += ok
            formatted += stop is not None and contract_answer(reply) is not None
            if len(samples) < 8:
                samples.append({"prompt": ex.prompt, "reply": reply, "answer": ex.answer})
    model.train(was_training)
    return GreedyAccuracy(task=task, n=n, accuracy=correct / n, format_rate=formatted / n, samples=samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--task", action="append", default=None)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for task in args.task or ["addition", "reverse"]:
        print(json.dumps(asdict(greedy_accuracy(args.model_dir, task, args.n))))


if __name__ == "__main__":
    main()
