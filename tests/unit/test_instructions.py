"""swarm.testing.instructions: the demo's data trains the answers only (the prompt's labels are -100), padding is
out of attention and loss (a character tokenizer with a chat template, so no model is needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from swarm.testing.instructions import IGNORE, instruction_batches, instruction_examples


class CharTokenizer:
    """One token per character; a chat template like SmolLM2's (the prompt ends with the assistant's cue)."""

    pad_token_id = 0

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) for c in text])


ROWS = [{"instruction": "Hi?", "response": "Arr!"}, {"instruction": "Longer question?", "response": "Aye."}]


def test_only_the_answer_and_the_end_of_its_turn_are_labelled():
    first, second = instruction_examples(CharTokenizer(), ROWS)
    prompt = len("<user>Hi?|<assistant>")
    assert first["input_ids"] == [ord(c) for c in "<user>Hi?|<assistant>Arr!|"]
    assert first["labels"] == [IGNORE] * prompt + [ord(c) for c in "Arr!|"]
    assert first["attention_mask"] == [1] * len(first["input_ids"])
    assert "".join(chr(t) for t in second["labels"] if t != IGNORE) == "Aye.|"


def test_batches_are_right_padded_and_padding_is_out_of_the_loss():
    (batch,) = instruction_batches(CharTokenizer(), ROWS, step=0, size=2, count=1)
    short = len("<user>Hi?|<assistant>Arr!|")
    assert batch["input_ids"].shape == (2, len("<user>Longer question?|<assistant>Aye.|"))
    assert batch["attention_mask"][0].sum() == short and torch.all(batch["input_ids"][0, short:] == 0)
    assert torch.all(batch["labels"][0, short:] == IGNORE)
    assert (batch["labels"] != IGNORE).sum() == len("Arr!|") + len("Aye.|")


def test_a_template_that_does_not_extend_its_prompt_is_an_error():
    class Odd(CharTokenizer):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return ("<cue>" if add_generation_prompt else "") + super().apply_chat_template(messages, tokenize, False)

    with pytest.raises(ValueError, match="does not start a conversation with its prompt"):
        instruction_examples(Odd(), ROWS)
