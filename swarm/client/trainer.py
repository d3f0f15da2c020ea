"""transformers' Trainer on a swarm model (promise 9): a user's Trainer script, with the model and the class name
swapped, trains the swarm's adapter as it trains a local peft model. What differs is here: the optimizer is the
peers' AdamW (``RemoteOptimizer``), the micro-batches of an accumulation run pipelined through the swarm, clipping is
global over every peer's blocks, and a checkpoint is a peft adapter folder plus Trainer's state, never the client's
embeddings. The weights and the AdamW state live in the swarm, so resuming loads nothing into it: it checks that the
checkpoint is this adapter's and continues at the step the swarm committed."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from swarm.blocks import lora_config_to_wire
from swarm.client.model import SwarmModelForCausalLM
from swarm.client.optimizer import RemoteOptimizer
from swarm.client.pipeline import run_pipelined

logger = logging.getLogger(__name__)

SWARM_CHECKPOINT = "swarm_checkpoint.json"  # what a checkpoint was saved from: adapter, base model, LoRA, swarm step
ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch's AdamW: what the peers apply (the fused kernel is the same math)


def check_training_args(args: transformers.TrainingArguments) -> None:
    """Refuse the options that cannot mean through a swarm what they mean locally, naming the option and what to
    do instead, rather than ignoring them."""
    optim = str(getattr(args.optim, "value", args.optim))
    peers_shard = "the blocks are sharded over the swarm's peers already; unset it"
    refused = [
        (
            optim not in ADAMW,
            f"optim={optim!r}: the peers apply torch's AdamW to their blocks' LoRA; use optim='adamw_torch' "
            "(learning_rate, adam_beta1/2, adam_epsilon and weight_decay are sent with every commit)",
        ),
        (
            args.optim_target_modules is not None,
            "optim_target_modules: the swarm's optimizer is AdamW over the whole adapter; unset it",
        ),
        (bool(args.deepspeed), f"deepspeed: {peers_shard}"),
        (bool(args.fsdp), f"fsdp: {peers_shard}"),
        (bool(args.fsdp_config), f"fsdp_config: {peers_shard}"),
        (
            args.torch_compile,
            "torch_compile: the client runs only the embeddings, norm and LM head (the blocks run on the peers); "
            "unset it",
        ),
        (
            args.fp16,
            "fp16: loss scaling would scale the gradients on the peers, which do not unscale them; "
            "use bf16=True, or open the model in the dtype you want "
            "(SwarmModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16))",
        ),
        (
            args.fp16_full_eval,
            "fp16_full_eval: it casts the client's modules only; open the model with dtype=torch.float16 instead",
        ),
        (
            args.bf16_full_eval,
            "bf16_full_eval: it casts the client's modules only; open the model with dtype=torch.bfloat16 instead",
        ),
        (
            args.load_best_model_at_end,
            "load_best_model_at_end: the swarm's adapter cannot be rolled back to an earlier step; set it to False "
            "and load the best checkpoint's adapter folder with peft.PeftModel.from_pretrained",
        ),
        (
            args.neftune_noise_alpha is not None,
            "neftune_noise_alpha: NEFTune is not supported through the swarm yet; unset it",
        ),
        (
            args.use_liger_kernel,
            "use_liger_kernel: Liger patches local decoder layers, and the client has none; set it to False",
        ),
        (
            args.label_smoothing_factor != 0,
            "label_smoothing_factor: not supported through the swarm yet; set it to 0",
        ),
    ]
    for bad, message in refused:
        if bad:
            raise ValueError(f"SwarmTrainer does not support {message}")


def check_model(model: Any) -> SwarmModelForCausalLM:
    """The model must be a swarm model opened for training."""
    if not isinstance(model, SwarmModelForCausalLM):
        raise TypeError(
            f"SwarmTrainer trains a swarm.SwarmModelForCausalLM, got {type(model).__name__}; use transformers.Trainer "
            "for a local model"
        )
    if not model.is_trainable:
        raise ValueError(
            f"adapter {model.adapter!r} was opened with is_trainable=False (a reader): open it with "
            "SwarmModelForCausalLM.from_pretrained(..., is_trainable=True) to train it"
        )
    return model


def _check_args(args: transformers.TrainingArguments, model: SwarmModelForCausalLM) -> None:
    check_training_args(args)
    device = torch.device(args.device)
    if device.type != model.device.type or (device.index or 0) != (model.device.index or 0):
        raise ValueError(
            f"the model's client modules are on {model.device} but the Trainer runs on {args.device}: open the "
            f"model with device={str(args.device)!r}, or set use_cpu=True in the TrainingArguments"
        )


def swarm_checkpoint(model: SwarmModelForCausalLM, global_step: int) -> dict:
    """What a checkpoint records of the swarm, so that a resume can check it continues the same adapter."""
    return {
        "swarm_step": model.step,
        "global_step": global_step,
        "adapter": model.adapter,
        "base_model": model.spec.name,
        "lora_config": lora_config_to_wire(model.lora_config),
    }


class SwarmTrainerMixin:
    """The swarm-specific overrides of transformers' Trainer, shared by ``SwarmTrainer`` and ``SwarmSFTTrainer``.

    ``max_in_flight``: how many micro-batches of a gradient accumulation are in the swarm at once (a pipeline: each
    span works on one micro-batch while the next works on another; None: ``model.in_flight()``, two per live
    server). The gradients are exactly those of Trainer's
    sequential loop: micro-batch ids are taken in data order, and the peers sum in id order."""

    model: SwarmModelForCausalLM

    def __init__(
        self,
        model: Any = None,
        args: transformers.TrainingArguments | None = None,
        *more,
        max_in_flight: int | None = None,
        **kwargs,
    ):
        check_model(model)
        if kwargs.get("model_init") is not None:
            raise ValueError("SwarmTrainer does not support model_init: pass the swarm model itself")
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(
                "SwarmTrainer does not support optimizer_cls_and_kwargs: the optimizer is the peers' AdamW, set by "
                "learning_rate, adam_beta1/2, adam_epsilon and weight_decay"
            )
        optimizer = (kwargs.get("optimizers") or (None, None))[0]
        if optimizer is not None and not (isinstance(optimizer, RemoteOptimizer) and optimizer.model is model):
            raise ValueError(
                "SwarmTrainer's optimizer must be a swarm.RemoteOptimizer of this model (or None, to build one from "
                f"the TrainingArguments), got {type(optimizer).__name__}"
            )
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._max_in_flight = max_in_flight
        if args is not None:
            _check_args(args, model)
        self._accumulation: list[dict] = []  # the batches of the accumulation in progress (get_batch_samples)
        self._losses: deque[tuple[dict, torch.Tensor]] = deque()  # their losses, once run, for training_step
        self._steps_ahead = 0  # on resume: steps the swarm committed after the checkpoint
        super().__init__(model, args, *more, **kwargs)
        if args is None:
            _check_args(self.args, model)
        # A causal LM's loss shifts its labels: count the step's label tokens over labels[..., 1:], as Trainer does
        # for a local causal LM (it recognises one by its loss_type, which the swarm model has no need of).
        self._loss_shifts_labels = True
        if model.step:
            logger.info("adapter %r is at swarm step %d: training continues from there", model.adapter, model.step)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The peers' AdamW with the TrainingArguments' hyperparameters. Trainer decays every trainable parameter but
        biases and norms: a swarm adapter is LoRA A/B matrices only (bias='none' is enforced), so every parameter is
        decayed and one group with ``weight_decay`` is Trainer's grouping."""
        if self.optimizer is None:
            args = self.args
            self.optimizer = RemoteOptimizer(
                self.model,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
        return self.optimizer

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | int | None]:
        """Trainer fetches an accumulation's batches up front: keep them, so the first ``training_step`` runs all."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._accumulation, self._losses = list(batch_samples), deque()
        return batch_samples, num_items_in_batch

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """On the accumulation's first batch, run every batch of it through the swarm, ``max_in_flight`` at once,
        each one Trainer's own ``training_step`` (``compute_loss`` and backward: a ``compute_loss`` override still
        applies); then return each batch's loss as Trainer asks for it."""
        if self._accumulation and inputs is self._accumulation[0] and len(self._accumulation) > 1:
            batches, self._accumulation = self._accumulation, []
            base = super()

            def start(batch: dict) -> Callable[[], torch.Tensor]:
                micro_batch = self.model.reserve_micro_batch()  # here, in data order: the order of the peers' sum

                def run() -> torch.Tensor:
                    with self.model.in_micro_batch(micro_batch):
                        return base.training_step(model, batch, num_items_in_batch)

                return run

            tokens = max((b["input_ids"].numel() for b in batches if "input_ids" in b), default=None)
            in_flight = self.model.in_flight(tokens) if self._max_in_flight is None else self._max_in_flight
            losses = run_pipelined(batches, start, in_flight)
            self._losses = deque(zip(batches, losses, strict=True))
        if self._losses and self._losses[0][0] is inputs:
            return self._losses.popleft()[1]
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Global clipping over every peer's blocks: the norm torch would compute over the whole adapter."""
        return self.model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The norm Trainer logs; with ``max_grad_norm=0`` it is computed (clipping at inf changes nothing)."""
        return self.model.clip_grad_norm_(math.inf) if grad_norm is None else grad_norm

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A standard peft adapter folder (adapter_config.json, adapter_model.safetensors) with the swarm's adapter
        at its committed step, what it was saved from (``swarm_checkpoint.json``), the tokenizer and the arguments;
        never the client's embeddings and head, which are the base model's."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        logger.info("Saving adapter %r at swarm step %d to %s", self.model.adapter, self.model.step, output_dir)
        self.model.save_adapter(output_dir)
        with open(os.path.join(output_dir, SWARM_CHECKPOINT), "w") as f:
            json.dump(swarm_checkpoint(self.model, self.state.global_step), f, indent=2)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The LR scheduler only: the AdamW state lives on the peers (and in their durable copies), so an
        optimizer.pt here would hold nothing but a placeholder."""
        if not self.args.should_save:
            return
        with warnings.catch_warnings(record=True) as caught:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load nothing (the adapter's weights and AdamW state are the swarm's): check that the checkpoint was saved
        from this adapter, and where the swarm is relative to it."""
        path = os.path.join(resume_from_checkpoint, SWARM_CHECKPOINT)
        if not os.path.isfile(path):
            raise ValueError(
                f"{resume_from_checkpoint} has no {SWARM_CHECKPOINT}: it was not saved by a SwarmTrainer, so it cannot "
                "say which adapter and step it holds; resume from a SwarmTrainer checkpoint"
            )
        with open(path) as f:
            saved = json.load(f)
        now = swarm_checkpoint(self.model, 0)
        for key, what in (("adapter", "adapter"), ("base_model", "base model"), ("lora_config", "LoRA config")):
            if saved[key] != now[key]:
                raise ValueError(
                    f"{resume_from_checkpoint} was saved from {what} {saved[key]!r} but this model has {now[key]!r}: "
                    f"open the model with the checkpoint's {what} (adapter {saved['adapter']!r} of "
                    f"{saved['base_model']!r}) to resume it, or train without resume_from_checkpoint"
                )
        ahead = self.model.step - saved["swarm_step"]
        if ahead < 0:
            raise ValueError(
                f"{resume_from_checkpoint} was saved at swarm step {saved['swarm_step']} but adapter "
                f"{saved['adapter']!r} is at step {self.model.step} in the swarm: {-ahead} committed step(s) are lost "
                "there (every copy of some block's state was). Resume from a checkpoint at or before swarm step "
                f"{self.model.step}, or train on from step {self.model.step} without resume_from_checkpoint"
            )
        if ahead:
            logger.warning(
                "adapter %r is at swarm step %d, %d step(s) past %s (the trainer stopped after committing them): "
                "resuming at global step %d",
                saved["adapter"],
                self.model.step,
                ahead,
                resume_from_checkpoint,
                saved["global_step"] + ahead,
            )
        self._steps_ahead = ahead

    def _init_training_state(
        self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int, resume_from_checkpoint, trial
    ) -> tuple[int, int]:
        """Trainer's, then moved on by the steps the swarm committed after the checkpoint (data skipped to match)."""
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None or not self._steps_ahead:
            return epochs_trained, steps_trained_in_current_epoch
        self.state.global_step += self._steps_ahead
        epochs_trained = self.state.global_step // num_update_steps_per_epoch
        steps_trained_in_current_epoch = 0
        if not self.args.ignore_data_skip:
            steps_trained_in_current_epoch = (
                self.state.global_step % num_update_steps_per_epoch
            ) * self.args.gradient_accumulation_steps
        return epochs_trained, steps_trained_in_current_epoch

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The scheduler only (there is no optimizer state to load: it is the swarm's), advanced by the steps the
        swarm committed after the checkpoint."""
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        advance = self._steps_ahead
        with warnings.catch_warnings(record=True) as caught:
            if os.path.isfile(path):
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            else:  # save_only_model: no scheduler state, so it is rebuilt by stepping it to the global step
                advance = self.state.global_step
            for _ in range(advance):
                self.lr_scheduler.step()
        # The learning rate in effect is the optimizer's, which Trainer restores from optimizer.pt: set it here
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        reissue_pt_warnings([w for w in caught if "lr_scheduler.step()" not in str(w.message)])


class SwarmTrainer(SwarmTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a ``swarm.SwarmModelForCausalLM``: the same arguments, logs and checkpoints."""
