"""SwarmTrainer refuses, at construction, the options that cannot mean through a swarm what they mean locally, each
naming the option; the options a recipe commonly sets and that do work are accepted. No swarm needed."""

from __future__ import annotations

import importlib
import sys

import pytest
import transformers
from torch import nn

import swarm
from swarm.client.model import SwarmModelForCausalLM
from swarm.client.trainer import check_model, check_training_args

REFUSED = {
    "optim": dict(optim="adafactor"),
    "optim_target_modules": dict(optim_target_modules=["q_proj"]),
    "fsdp": dict(fsdp="full_shard"),
    "fsdp_config": dict(fsdp_config={"min_num_params": 1}),
    "torch_compile": dict(torch_compile=True),
    "fp16": dict(fp16=True),
    "fp16_full_eval": dict(fp16_full_eval=True),
    "bf16_full_eval": dict(bf16_full_eval=True),
    "load_best_model_at_end": dict(
        load_best_model_at_end=True, metric_for_best_model="loss", eval_strategy="steps", save_strategy="steps"
    ),
    "neftune_noise_alpha": dict(neftune_noise_alpha=5.0),
    "use_liger_kernel": dict(use_liger_kernel=True),
    "label_smoothing_factor": dict(label_smoothing_factor=0.1),
}


def arguments(tmp_path, **options) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **options)


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_each_refused_option_raises_naming_it(option, tmp_path):
    try:
        args = arguments(tmp_path, **REFUSED[option])
    except (ValueError, ImportError) as e:  # TrainingArguments itself refuses it on this machine (no GPU, no liger)
        pytest.skip(f"TrainingArguments refuses {option} here: {e}")
    with pytest.raises(ValueError, match=f"does not support {option}"):
        check_training_args(args)


def test_deepspeed_is_refused(tmp_path):
    args = arguments(tmp_path)
    args.deepspeed = "ds_config.json"  # set after __post_init__, which would need deepspeed installed
    with pytest.raises(ValueError, match="does not support deepspeed"):
        check_training_args(args)


@pytest.mark.parametrize(
    "options",
    [
        {},  # the default optim (adamw_torch_fused in this transformers)
        dict(optim="adamw_torch"),
        dict(gradient_checkpointing=True),  # a QLoRA recipe's: nothing to do on the client, accepted
        dict(bf16=True, max_grad_norm=0.0, remove_unused_columns=True, gradient_accumulation_steps=8),
    ],
)
def test_common_recipe_options_are_accepted(options, tmp_path):
    check_training_args(arguments(tmp_path, **options))


def test_a_model_that_is_not_a_swarm_model_is_refused(tmp_path):
    with pytest.raises(TypeError, match="trains a swarm.SwarmModelForCausalLM, got Linear"):
        swarm.SwarmTrainer(model=nn.Linear(2, 2), args=arguments(tmp_path))


def test_a_reader_is_refused():
    """A model opened with is_trainable=False has a reader's session, not a TrainingSession."""
    reader = SwarmModelForCausalLM.__new__(SwarmModelForCausalLM)
    nn.Module.__init__(reader)
    reader.session, reader.adapter = object(), "pirate"
    with pytest.raises(ValueError, match="'pirate' was opened with is_trainable=False"):
        check_model(reader)


def test_sft_options_that_need_position_ids_are_refused(tmp_path):
    import trl

    from swarm.client.sft import check_sft_args

    for option in ("packing", "padding_free"):
        config = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, **{option: True})
        with pytest.raises(ValueError, match=f"does not support {option}=True"):
            check_sft_args(config)


def test_trl_is_imported_only_for_the_sft_trainer(monkeypatch):
    """``swarm.SwarmTrainer``'s module imports without trl (a heavy import most users of Trainer do not need); only
    ``swarm.SwarmSFTTrainer``'s needs it."""
    assert (swarm._LAZY["SwarmTrainer"], swarm._LAZY["SwarmSFTTrainer"]) == ("swarm.client.trainer", "swarm.client.sft")
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "swarm.client.trainer")  # restored after the test
    assert importlib.import_module("swarm.client.trainer").SwarmTrainer
    monkeypatch.delitem(sys.modules, "swarm.client.sft", raising=False)
    with pytest.raises(ImportError):
        importlib.import_module("swarm.client.sft")
