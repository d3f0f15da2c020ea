"""The demo's instruction set (data/pirate_instructions.jsonl) in the model's chat format, for the demo and the
real-model tests."""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[2] / "data" / "pirate_instructions.jsonl"
QUESTIONS = ["What is the capital of Germany?", "How many wheels does a bicycle have?"]  # not in the data


def chat(tokenizer, question: str, answer: str | None = None) -> str:
    """The model's own chat format: a question, and its answer (for training) or the cue to answer (to generate)."""
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=answer is None)


def instruction_batches(tokenizer, rows: list[dict], step: int, size: int = 4, count: int = 2) -> list[dict]:
    """The ``count`` micro-batches of ``size`` conversations for ``step`` (cycling through the data), right-padded;
    the loss covers every real token, none of the padding."""
    first = step * size * count
    batches = []
    for part in range(count):
        picked = [rows[(first + part * size + i) % len(rows)] for i in range(size)]
        ids = [tokenizer(chat(tokenizer, r["instruction"], r["response"])).input_ids for r in picked]
        length = max(len(x) for x in ids)
        input_ids = torch.full((size, length), tokenizer.pad_token_id or 0)
        attention_mask = torch.zeros_like(input_ids)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = torch.tensor(x)
            attention_mask[row, : len(x)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batches.append(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels))
    return batches
