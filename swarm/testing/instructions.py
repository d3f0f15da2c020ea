"""The demo's instruction set (data/pirate_instructions.jsonl) in the model's chat format, for the demo and the
real-model tests. As in supervised fine-tuning recipes, the loss covers the answers only: the question and the chat
template around it are context the model is given, not text it should learn to write."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[2] / "data" / "pirate_instructions.jsonl"
QUESTIONS = ["What is the capital of Germany?", "How many wheels does a bicycle have?"]  # not in the data
IGNORE = -100  # the label that the loss (torch's cross entropy, transformers' models) skips


def read_rows(path: Path = DATA) -> list[dict]:
    """The conversations of a JSONL file: one ``{"instruction": ..., "response": ...}`` a line."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat(tokenizer, question: str, answer: str | None = None) -> str:
    """The model's own chat format: a question, and its answer (for training) or the cue to answer (to generate)."""
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=answer is None)


def instruction_examples(tokenizer, rows: list[dict]) -> list[dict[str, list[int]]]:
    """Each conversation tokenized (``input_ids``, ``attention_mask``, ``labels``, unpadded, as a ``Trainer``'s
    dataset holds them), with the labels of the prompt (the question in its chat template, up to the assistant's
    cue) set to ``IGNORE``: only the answer's tokens, and the end of its turn, are trained."""
    examples = []
    for row in rows:
        prompt = tokenizer(chat(tokenizer, row["instruction"])).input_ids
        ids = tokenizer(chat(tokenizer, row["instruction"], row["response"])).input_ids
        if ids[: len(prompt)] != prompt:
            raise ValueError(f"the chat template does not start a conversation with its prompt: {row['instruction']!r}")
        labels = [IGNORE] * len(prompt) + ids[len(prompt) :]
        examples.append(dict(input_ids=ids, attention_mask=[1] * len(ids), labels=labels))
    return examples


def collate(examples: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One micro-batch of examples, right-padded; padding is masked out of attention and of the loss."""
    length = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, IGNORE)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.tensor(e["input_ids"])
        attention_mask[row, :n] = torch.tensor(e["attention_mask"])
        labels[row, :n] = torch.tensor(e["labels"])
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def instruction_batches(tokenizer, rows: list[dict], step: int, size: int = 4, count: int = 2) -> list[dict]:
    """The ``count`` micro-batches of ``size`` conversations for ``step`` (cycling through the data); the loss covers
    the answers' tokens only."""
    first = step * size * count
    picked = [rows[(first + i) % len(rows)] for i in range(size * count)]
    examples = instruction_examples(tokenizer, picked)
    pad = tokenizer.pad_token_id or 0
    return [collate(examples[part * size : (part + 1) * size], pad) for part in range(count)]
