"""Which ``peft.LoraConfig`` options the swarm honours and which it refuses: every field of the config is decided here,
so that none is accepted and then silently dropped on its way to the peers."""

from __future__ import annotations

import copy
import dataclasses

import peft
import torch
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from swarm.net.errors import AdapterConfigError
from swarm.spec import ModelSpec

# Sent to the peers and honoured there (peft's own code applies them to each block, named as in the full model).
HONOURED: dict[str, str] = {
    "r": "the rank",
    "lora_alpha": "the scaling numerator",
    "target_modules": "which projections get LoRA ('all-linear' is resolved on the client into their names)",
    "exclude_modules": "projections left out",
    "lora_dropout": "dropout before lora_A, masks seeded by (adapter seed, step, micro-batch, block)",
    "fan_in_fan_out": "the layout of the base weights",
    "bias": "only 'none': the swarm trains LoRA matrices, not the base biases",
    "use_rslora": "scaling lora_alpha / sqrt(r)",
    "use_dora": "DoRA: a magnitude vector per projection, initialised from the base weight",
    "layers_to_transform": "which decoder blocks get LoRA",
    "layers_pattern": "the name of the layer list the block indices refer to",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
}
# Sent only when not at their defaults, so that the identity of an adapter made before they travelled is unchanged.
OPTIONAL_ON_WIRE = (
    "exclude_modules",
    "use_dora",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
)
# Describe the adapter file or the local runtime, not the math: kept on the client, written on export, never sent.
METADATA: dict[str, str] = {
    "task_type": "written as CAUSAL_LM on export",
    "peft_type": "always LORA",
    "auto_mapping": "file metadata",
    "peft_version": "file metadata",
    "base_model_name_or_path": "written on export",
    "revision": "file metadata",
    "inference_mode": "the client's is_trainable decides",
    "runtime_config": "local runtime options (GPU offload at load time), nothing the peers compute",
    "megatron_core": "only read with megatron_config, which is refused",
    "qalora_group_size": "only read with use_qalora, which is refused",
}
# Refused when not at their default value, with what to do instead.
REFUSED: dict[str, str] = {
    "modules_to_save": "the swarm trains only LoRA tensors of decoder blocks; drop modules_to_save",
    "init_lora_weights": "the swarm initialises LoRA deterministically (kaiming A, zero B); leave it True",
    "megatron_config": "Megatron parallel layers are not used by swarm blocks; leave it None",
    "trainable_token_indices": "embeddings stay frozen on the client; leave it None",
    "loftq_config": "LoftQ initialisation is not supported; leave it empty",
    "eva_config": "EVA initialisation is not supported; leave it None",
    "corda_config": "CorDA initialisation is not supported; leave it None",
    "lora_ga_config": "LoRA-GA initialisation is not supported; leave it None",
    "velora_config": "VeLoRA is not supported; leave it None",
    "alora_invocation_tokens": "activated LoRA is not supported; leave it None",
    "use_qalora": "QALoRA is not supported; use --quant nf4 peers with plain LoRA instead",
    "monteclora_config": "MonteCLoRA is not supported; leave it None",
    "layer_replication": "peers serve the model's own blocks; leave it None",
    "lora_bias": "LoRA bias terms are not trained in the swarm; leave it False",
    "target_parameters": "LoRA on bare parameters (the fused experts or the router of a mixture-of-experts block) is "
    "not supported: peers train LoRA on nn.Linear projections only; name the attention projections in target_modules",
    "use_bdlora": "BD-LoRA is not supported; leave it None",
    "arrow_config": "Arrow routing is not supported; leave it None",
    "kasa_config": "KaSA is not supported; leave it None",
    "astra_config": "ASTRA initialisation is not supported; leave it None",
    "ensure_weight_tying": "the swarm never adapts embeddings or the LM head, so nothing to tie; leave it False",
}


def field_default(name: str) -> object:
    """The declared default of a ``LoraConfig`` field."""
    field = {f.name: f for f in dataclasses.fields(peft.LoraConfig)}[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def undecided_fields() -> set[str]:
    """Fields of the installed peft's LoraConfig that this module takes no decision on (must be empty)."""
    decided = set(HONOURED) | set(METADATA) | set(REFUSED)
    return {f.name for f in dataclasses.fields(peft.LoraConfig)} - decided


def check_lora_config(config: peft.LoraConfig) -> None:
    """Raise ``AdapterConfigError`` naming the first option the swarm cannot honour, and what to do."""
    if not isinstance(config, peft.LoraConfig):
        raise AdapterConfigError(f"lora_config must be a peft.LoraConfig, got {type(config).__name__}")
    undecided = undecided_fields()
    if undecided:
        raise AdapterConfigError(f"this peft has LoraConfig fields the swarm does not know: {sorted(undecided)}")
    for name, what_to_do in REFUSED.items():
        if getattr(config, name) != field_default(name):
            raise AdapterConfigError(f"LoraConfig.{name}={getattr(config, name)!r} is not supported: {what_to_do}")
    if config.bias != "none":
        raise AdapterConfigError(f"LoraConfig.bias={config.bias!r} is not supported: {HONOURED['bias']}")
    if not config.r or config.r <= 0:
        raise AdapterConfigError(f"LoraConfig.r must be positive, got {config.r}")
    if config.use_dora and config.lora_dropout:
        raise AdapterConfigError(
            "LoraConfig.use_dora with lora_dropout > 0 is not supported (peft skips DoRA's dropout in eval mode, "
            "where peers run blocks): set lora_dropout=0 or use_dora=False"
        )


class BlockShell(nn.Module):
    """Decoder blocks named as in the full model (``model.layers.{block}``): peft's own matching of
    ``layers_to_transform``, ``layers_pattern``, ``rank_pattern``, ``alpha_pattern`` and ``exclude_modules`` against
    full module names then works unchanged on one block, and the blocks' own parameter names stay block-local."""

    def __init__(self, spec: ModelSpec, layers: dict[int, nn.Module]):
        super().__init__()
        for block, layer in layers.items():
            *path, leaf = spec.block_prefix(block).rstrip(".").split(".")
            parent: nn.Module = self
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.ModuleDict() if part == path[-1] else nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, layer)


def has_lora(config: peft.LoraConfig, spec: ModelSpec, block: int, layer: nn.Module) -> bool:
    """Whether the config puts LoRA on some module of block ``block`` (``layer``: that block, or any block of the
    model: they have the same modules), as peft matches full names: ``layers_to_transform`` or a target naming some
    blocks only leave the others without LoRA."""
    prefix = spec.block_prefix(block)
    return any(check_target_module_exists(config, prefix + name) for name, _ in layer.named_modules() if name)


def blocks_without_lora(config: peft.LoraConfig, spec: ModelSpec) -> set[int]:
    """The blocks that get no LoRA tensor: they train nothing and export nothing."""
    with torch.device("meta"):  # each block's own: Qwen3-MoE's dense blocks have other modules than its sparse ones
        decoder = spec.family_class("DecoderLayer")
        layers = {block: decoder(spec.config, layer_idx=block) for block in range(spec.num_blocks)}
    return {block for block, layer in layers.items() if not has_lora(config, spec, block, layer)}


def linear_names(layer: nn.Module) -> set[str]:
    """The names of a block's linear projections, as peft resolves ``target_modules='all-linear'`` for a causal LM
    (the LM head is the client's and never a block's)."""
    return {name.rsplit(".", 1)[-1] for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def peft_expert_targets(config: peft.LoraConfig, spec: ModelSpec, layers: dict[int, nn.Module]) -> set[str]:
    """What local peft adapts as bare parameters on this family's model although ``config`` names modules: under
    transformers 5, peft (``convert_peft_config_for_transformers``) reads a Mixtral or Qwen3-MoE config's expert and
    router names (``w1`` / ``w3`` / ``w2``; ``gate_proj`` / ``up_proj`` / ``down_proj``, which are also the names of
    Qwen3-MoE's dense MLP; ``gate``; and what ``'all-linear'`` meant for the v4 model) as the fused experts'
    ``gate_up_proj`` / ``down_proj`` and the router's ``gate.weight``. Empty for every other family."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the conversion: it adapts what the names name
        return set()
    probe = copy.deepcopy(config)
    shell = BlockShell(spec, layers)
    shell.config = spec.config  # what peft reads the model type from, as on the full model
    convert_peft_config_for_transformers(probe, model=shell, conversions=None)
    return set(probe.target_parameters or ())


def resolve_lora_config(config: peft.LoraConfig, spec: ModelSpec) -> peft.LoraConfig:
    """The config the peers get: checked, ``target_modules`` explicit (``'all-linear'`` and None resolved as local peft
    resolves them for this model), and tried on the model's blocks on the meta device, so that options matching no
    projection anywhere fail here, before anything is joined."""
    check_lora_config(config)
    resolved = copy.deepcopy(config)
    with torch.device("meta"):
        decoder = spec.family_class("DecoderLayer")
        layers = {block: decoder(spec.config, layer_idx=block) for block in range(spec.num_blocks)}
    experts = peft_expert_targets(config, spec, layers)
    if experts:
        raise AdapterConfigError(
            f"LoraConfig.target_modules={config.target_modules!r} on {spec.family} is not supported: local peft puts "
            f"that LoRA on the bare parameters {sorted(experts)} (transformers 5 fuses each block's experts into 3-D "
            "parameters and its router is no nn.Linear, so peft adapts them as target_parameters), and peers train "
            "LoRA on nn.Linear projections only; name the attention projections instead, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj']"
        )
    if resolved.target_modules is None:
        defaults = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(spec.family)
        if defaults is None:
            raise AdapterConfigError(f"LoraConfig.target_modules: peft has no default for {spec.family!r}; name them")
        resolved.target_modules = set(defaults)
    elif isinstance(resolved.target_modules, str) and resolved.target_modules.lower() == "all-linear":
        resolved.target_modules = set().union(*(linear_names(layer) for layer in layers.values()))
    try:
        # LoRA tensors on the meta device as well, by this thread's device mode: peft's low_cpu_mem_usage would patch
        # nn.Module for every thread of the process (a module built meanwhile elsewhere got meta weights)
        with torch.device("meta"):
            peft.inject_adapter_in_model(copy.deepcopy(resolved), BlockShell(spec, layers))
    except ValueError as e:
        raise AdapterConfigError(f"LoraConfig.target_modules {config.target_modules!r} on this model: {e}") from None
    return resolved
