"""TRL's SFTTrainer on a swarm model: TRL's data preparation, collator and loss (its fused LM head patches the swarm
model as any causal LM, see ``SwarmModelForCausalLM.base_model``), with the swarm's optimizer, pipelined
accumulation, clipping and checkpoints (``SwarmTrainerMixin``). Importing this module imports trl."""

from __future__ import annotations

from typing import Any

import trl

from swarm.client.trainer import SwarmTrainerMixin


def check_sft_args(args: trl.SFTConfig) -> None:
    """Refuse the SFT options the swarm model cannot honour: packed or padding-free batches need position_ids (one
    row holding several sequences), which the swarm's blocks do not take."""
    for name in ("packing", "padding_free"):
        if getattr(args, name):
            raise ValueError(
                f"SwarmSFTTrainer does not support {name}=True: the swarm's blocks take padded batches with an "
                f"attention_mask, not packed sequences with position_ids; set {name}=False"
            )


class SwarmSFTTrainer(SwarmTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` for a ``swarm.SwarmModelForCausalLM`` (pass ``processing_class``: the swarm model has no
    tokenizer of its own, see ``swarm.load_tokenizer``)."""

    def __init__(self, model: Any = None, args: trl.SFTConfig | None = None, *more, **kwargs):
        if isinstance(args, trl.SFTConfig):
            check_sft_args(args)
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                "SwarmSFTTrainer does not take peft_config: the swarm model's adapter is the one it opened "
                "(SwarmModelForCausalLM.from_pretrained(..., lora_config=...))"
            )
        super().__init__(model, args, *more, **kwargs)
        check_sft_args(self.args)
