"""Build one decoder block from its own tensors on disk, quantize it, and give it deterministic LoRA."""

from __future__ import annotations

import copy
import hashlib
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import peft
import torch
from safetensors import safe_open
from torch import nn

from swarm.dropout import seeded_dropout
from swarm.lora_options import (
    OPTIONAL_ON_WIRE,
    BlockShell,
    check_lora_config,
    field_default,
    has_lora,
)
from swarm.net.errors import AdapterConfigError
from swarm.net.numerics import DTYPE_NAMES, QUANT_MODES
from swarm.spec import ModelSpec

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
PATTERN_UNMATCHED = "The following (rank|alpha)_pattern keys did not match"
LORA_FIELDS = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora", "fan_in_fan_out")


def stored_tensors(spec: ModelSpec, block: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Block ``block``'s tensors as stored in the folder (all, or ``names``, relative to the block), by name
    relative to the block."""
    prefix = spec.block_prefix(block)
    wanted = spec.tensor_names(prefix) if names is None else [prefix + name for name in names]
    state: dict[str, torch.Tensor] = {}
    for path, full_names in spec.files_for(wanted).items():
        with safe_open(str(path), framework="pt") as f:
            for name in full_names:
                state[name.removeprefix(prefix)] = f.get_tensor(name)
    return state


def load_block(
    spec: ModelSpec,
    block: int,
    device: torch.device,
    dtype: torch.dtype,
    quant: str,
    stored: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Build block ``block`` with transformers' own class, reading only that block's tensors (or taking them from
    ``stored``, as ``stored_tensors`` read them: copied, never shared)."""
    if quant not in QUANT_MODES:
        raise ValueError(f"--quant must be one of {QUANT_MODES}, got {quant!r}")
    stored = stored_tensors(spec, block) if stored is None else stored
    state = fused_experts(spec, {name: tensor.to(dtype, copy=True) for name, tensor in stored.items()})
    with torch.device("meta"):
        layer = spec.family_class("DecoderLayer")(spec.config, layer_idx=block)
    layer.load_state_dict(state, strict=True, assign=True)
    layer.requires_grad_(False)
    if quant != "none":
        _quantize_linears(layer, quant, dtype)
    return layer.to(device).eval()


# How a mixture-of-experts checkpoint stores a block's experts, one nn.Linear per expert and projection (the layout of
# every hub checkpoint: transformers 5 saves it so too), and what the family's module holds: each sparse block's
# experts fused into 3-D parameters ``mlp.experts.gate_up_proj`` (experts, 2 x intermediate, hidden: gate rows, then
# up rows) and ``mlp.experts.down_proj`` (experts, hidden, intermediate), as transformers' conversion mapping for the
# family fuses them at load. Per family: the stored MoE module's name, then the gate, up and down projections' names.
EXPERT_LAYOUT = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def fused_experts(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block's stored tensors (names relative to the block) in its module's layout: per-expert projections fused
    as the family's experts hold them, the MoE module renamed ``mlp`` (Mixtral's ``block_sparse_moe``); the state of
    any other family, or already fused, unchanged."""
    if spec.family not in EXPERT_LAYOUT:
        return state
    moe, gate, up, down = EXPERT_LAYOUT[spec.family]
    experts = sorted(
        {int(name.split(".")[2]) for name in state if name.startswith(f"{moe}.experts.") and name.endswith(".weight")}
    )
    if not experts:
        return state
    if experts != list(range(len(experts))):
        raise ValueError(f"the block's experts are numbered {experts}, not 0..{len(experts) - 1}")

    def take(projection: str) -> list[torch.Tensor]:
        return [state.pop(f"{moe}.experts.{e}.{projection}.weight") for e in experts]

    fused = {
        "mlp.experts.gate_up_proj": torch.stack([torch.cat(pair) for pair in zip(take(gate), take(up), strict=True)]),
        "mlp.experts.down_proj": torch.stack(take(down)),
    }
    renamed = {
        f"mlp.{name.removeprefix(moe + '.')}" if name.startswith(moe + ".") else name: t for name, t in state.items()
    }
    return {**renamed, **fused}


def _quantize_linears(module: nn.Module, quant: str, compute_dtype: torch.dtype) -> None:
    """Swap every nn.Linear for its bitsandbytes twin; the weights are quantized when moved to a device."""
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            bias = child.bias is not None
            if quant == "nf4":
                new = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=bias, compute_dtype=compute_dtype, quant_type="nf4"
                )
                new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights for inference at the first eval-mode
                # forward without grad, and the packed kernel has no backward: a block that served an evaluation
                # could not train any more. The same block serves both, so keep the trainable layout.
                new.support_avx512bf16_for_cpu = False
            else:
                new = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=bias, has_fp16_weights=False, threshold=0.0
                )
                new.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
            if bias:
                new.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, new)
        else:
            _quantize_linears(child, quant, compute_dtype)


def _plain(value: object) -> object:
    """Sets (peft turns lists of names into sets) as sorted lists, so that a config has one msgpack form."""
    return sorted(value) if isinstance(value, set | frozenset) else value


def _check_for_peers(config: peft.LoraConfig) -> None:
    """What a peer can build: a config the swarm honours, with explicit targets (it does not hold the whole model)."""
    check_lora_config(config)
    targets = config.target_modules
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        raise AdapterConfigError(
            f"LoraConfig.target_modules={targets!r} needs the model: resolve it with "
            "swarm.lora_options.resolve_lora_config (from_pretrained does) or name the projections"
        )


def lora_config_to_wire(config: peft.LoraConfig) -> dict:
    """The fields of a LoRA config that decide its math, in a msgpack-friendly form; options at their defaults are
    left out, so that an adapter's identity does not change when the swarm learns a new option."""
    _check_for_peers(config)
    wire = {name: _plain(getattr(config, name)) for name in LORA_FIELDS}
    wire.update(
        {
            name: _plain(getattr(config, name))
            for name in OPTIONAL_ON_WIRE
            if getattr(config, name) != field_default(name)
        }
    )
    return wire


def lora_config_from_wire(wire: dict) -> peft.LoraConfig:
    """Rebuild and check a LoRA config: the swarm trains only what it can reproduce bit for bit."""
    unknown = set(wire) - set(LORA_FIELDS) - set(OPTIONAL_ON_WIRE)
    if unknown:
        raise AdapterConfigError(
            f"unknown LoRA fields {sorted(unknown)}; supported: {list(LORA_FIELDS) + list(OPTIONAL_ON_WIRE)}"
        )
    config = peft.LoraConfig(**wire)
    _check_for_peers(config)
    return config


def block_seed(adapter_seed: int, block: int) -> int:
    """A 63-bit seed from (adapter seed, block index), the same on every peer."""
    digest = hashlib.sha256(f"swarm-lora:{adapter_seed}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class LoraParam:
    """One trainable LoRA tensor of a block: its name inside the block (as in a peft file) and the tensor."""

    name: str
    param: nn.Parameter


def kaiming_uniform(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """peft's init of LoRA A (``kaiming_uniform_`` with a=sqrt(5): uniform in +-1/sqrt(fan_in)) in the same bits on
    every machine: ``uniform_(-b, b)`` fuses its scaling differently under other CPU kernels, so the uniform draws of
    a CPU generator are scaled by two separately rounded operations instead."""
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator, dtype=torch.float32).mul_(2.0 * bound).sub_(bound)


def add_lora(
    layer: nn.Module, spec: ModelSpec, block: int, adapter: str, config: peft.LoraConfig, seed: int
) -> list[LoraParam]:
    """Inject a LoRA adapter into a block and initialise it from (seed, block) alone: A kaiming, B zero, a DoRA
    magnitude as peft computes it from the base weight. A block that the config leaves out (``layers_to_transform``)
    gets none; the client checked that some block gets LoRA."""
    if not has_lora(config, spec, block, layer):
        return []
    try:
        with warnings.catch_warnings():  # a pattern naming other blocks matches none here; the client warns once
            warnings.filterwarnings("ignore", PATTERN_UNMATCHED, RuntimeWarning)
            peft.inject_adapter_in_model(copy.deepcopy(config), BlockShell(spec, {block: layer}), adapter_name=adapter)
    except ValueError as e:
        raise AdapterConfigError(f"LoRA config does not fit block {block}: {e}") from None
    marker = f".{adapter}."
    params = sorted(
        (LoraParam(name.replace(marker, "."), p) for name, p in layer.named_parameters() if marker in name),
        key=lambda lp: lp.name,
    )
    generator = torch.Generator().manual_seed(block_seed(seed, block))
    with torch.no_grad():
        for lp in params:
            # fp32 on a half-precision base too, as peft's own models keep adapters (``autocast_adapter_dtype``):
            # a bf16 replica then holds the same bits as an fp32 one, and trains as local peft does
            lp.param.data = lp.param.data.float()
            lp.param.requires_grad_(True)
            kind = lp.name.split(".")[-2]
            if kind == "lora_A":
                lp.param.copy_(kaiming_uniform(lp.param.shape, generator))
            elif kind == "lora_B":
                lp.param.zero_()
            elif kind == "lora_magnitude_vector":
                lp.param.copy_(dora_magnitude(spec, block, lp.name.split(".lora_magnitude_vector")[0], config))
            else:
                raise AdapterConfigError(f"LoRA tensor {lp.name} of block {block} has no deterministic init here")
    if config.lora_dropout:
        seeded_dropout(layer, adapter, config.lora_dropout, block)
    return params


def dora_magnitude(spec: ModelSpec, block: int, module: str, config: peft.LoraConfig) -> torch.Tensor:
    """DoRA's initial magnitude of ``module``: the norm of each output row of its weight (B is zero), as peft
    computes it, but from the weight as stored, not as this peer quantized it, and summed in float64 so that the
    order of the sum does not show: every replica, of any numerics, starts from the same bits."""
    weight = stored_tensors(spec, block, [f"{module}.weight"])[f"{module}.weight"].double()
    if config.fan_in_fan_out:
        weight = weight.T
    return weight.square().sum(dim=1).sqrt().float()


def spans_text(blocks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0:3,5:6"``: blocks as START:END runs, for messages."""
    runs: list[Iterable[int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block:
            runs[-1][1] = block + 1
        else:
            runs.append([block, block + 1])
    return ",".join(f"{a}:{b}" for a, b in runs) or "nothing"
