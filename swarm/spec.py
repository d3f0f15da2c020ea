"""What a model folder is: its config, its family's classes, and where each tensor lives on disk."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from swarm.net.errors import ModelFolderError

SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
)
# Config fields a family's decoder layer applies in training only (dropout): peers run blocks in eval mode, so a
# folder that sets one would train otherwise than local peft does, and is refused.
TRAINING_ONLY_FIELDS = {
    "phi3": ("resid_pdrop", "attention_dropout"),
    "gemma2": ("attention_dropout",),
    "gemma3_text": ("attention_dropout",),
    # Mixtral's router multiplies its input by uniform noise in training (``router_jitter_noise``)
    "mixtral": ("router_jitter_noise", "attention_dropout"),
    "qwen3_moe": ("attention_dropout",),
}
# Config fields whose every true value the swarm cannot serve as the family's model computes it, with why.
UNSERVED_FIELDS = {
    family: {
        "use_bidirectional_attention": "the model then builds bidirectional masks (an encoder, as EmbeddingGemma), "
        "and peers build the causal masks of a decoder; set it to false in config.json"
    }
    for family in ("gemma2", "gemma3_text")
}
# Mixture-of-experts: with ``output_router_logits`` the model adds ``router_aux_loss_coef`` times the routers'
# load-balancing loss to the loss (transformers' default is off, as in Mixtral's and Qwen3-MoE's config.json).
MOE_FAMILIES = ("mixtral", "qwen3_moe")
UNSERVED_FIELDS.update(
    {
        family: {
            "output_router_logits": "the model then adds router_aux_loss_coef x the routers' load-balancing loss, "
            "computed from every block's router logits, to the loss, and peers hand the client only hidden states, "
            "so the swarm's loss and gradients would not be the model's; set it to false in config.json"
        }
        for family in MOE_FAMILIES
    }
)
# Families whose model multiplies the input embeddings by sqrt(hidden_size), in the embeddings' dtype (their
# ``TextScaledWordEmbedding``): the client, which holds the embeddings, scales them as they do.
SCALED_EMBEDDINGS = ("gemma2", "gemma3_text")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


@dataclass
class ModelSpec:
    """A Llama-family model folder: config plus a map from tensor name to its safetensors file."""

    path: Path
    config: transformers.PretrainedConfig
    weight_files: dict[str, Path] = field(repr=False)
    model_name: str | None = None  # the name given (a hub model's, with its revision); None: the folder's name

    @property
    def family(self) -> str:
        return self.config.model_type

    @property
    def num_blocks(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def name(self) -> str:
        """The name peers and clients agree on in DHT keys: the folder's own name, or the one given (a model by hub
        id is ``ORG--NAME@<commit>``: swarm/hub.py)."""
        return self.model_name or self.path.resolve().name

    @property
    def modeling(self) -> ModuleType:
        """The transformers module that defines this family's classes."""
        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.family]
        module = sys.modules[getattr(transformers, class_name).__module__]
        return module

    def family_class(self, suffix: str) -> type:
        """A class of this family by suffix, e.g. ``DecoderLayer`` -> ``LlamaDecoderLayer``."""
        prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.family].removesuffix("ForCausalLM")
        return getattr(self.modeling, prefix + suffix)

    def attention_kind(self, block: int) -> str:
        """``full_attention`` or ``sliding_attention`` for a block, as the family's model decides it."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return layer_types[block]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    @property
    def embed_scale(self) -> float | None:
        """What the family's model multiplies the input embeddings by (Gemma: sqrt(hidden_size)), or None."""
        return self.hidden_size**0.5 if self.family in SCALED_EMBEDDINGS else None

    @property
    def logit_softcapping(self) -> float | None:
        """Gemma's final logit soft-capping: the model's logits are ``tanh(logits / cap) * cap``; None: none."""
        return getattr(self.config, "final_logit_softcapping", None)

    def block_prefix(self, block: int) -> str:
        return f"model.layers.{block}."

    def files_for(self, names: list[str]) -> dict[Path, list[str]]:
        """Group tensor names by the shard that holds them, so each shard is opened once."""
        grouped: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.weight_files:
                raise ModelFolderError(
                    f"{self.path}: tensor {name!r} is in no safetensors file; is the folder complete?"
                )
            grouped.setdefault(self.weight_files[name], []).append(name)
        return grouped

    def tensor_names(self, prefix: str) -> list[str]:
        return sorted(name for name in self.weight_files if name.startswith(prefix))


def load_spec(model_dir: str | Path, name: str | None = None) -> ModelSpec:
    """Read config.json and the safetensors layout of an HF model folder, without loading any tensor. ``name``: the
    model's name in the swarm, if not the folder's (swarm/hub.py gives a hub model's)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{path}: no config.json; point --model at a Hugging Face model folder")
    config = transformers.AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelFolderError(
            f"{path}: model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    for field_name in TRAINING_ONLY_FIELDS.get(config.model_type, ()):  # not ``name``: that is the argument
        if getattr(config, field_name, 0.0):
            raise ModelFolderError(
                f"{path}: {config.model_type} with {field_name}={getattr(config, field_name)} is not supported: its "
                "decoder layers apply that dropout in training, and peers run blocks without it; set it to 0.0 in "
                "config.json"
            )
    for field_name, why in UNSERVED_FIELDS.get(config.model_type, {}).items():
        if getattr(config, field_name, None):
            raise ModelFolderError(
                f"{path}: {config.model_type} with {field_name}={getattr(config, field_name)} is not supported: {why}"
            )
    config._attn_implementation = attention_implementation(config.model_type)
    if config.model_type in MOE_FAMILIES:
        config._experts_implementation = experts_implementation(config.model_type)
    return ModelSpec(path=path, config=config, weight_files=_weight_files(path), model_name=name)


def attention_implementation(model_type: str) -> str:
    """The attention peers (and the parity tests' local reference) run: sdpa, or eager for a family whose model does
    not support sdpa (Gemma 2: sdpa has no attention-logit soft-capping), as transformers itself would choose."""
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return "sdpa" if model_class._supports_sdpa else "eager"


def experts_implementation(model_type: str) -> str:
    """How a mixture-of-experts family's fused experts run, as transformers' ``from_pretrained`` chooses by default
    (``grouped_mm`` where the experts class dispatches on it, else the class's own loop): what local peft runs, so
    that peers run the same kernels."""
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return "grouped_mm" if model_class._can_set_experts_implementation() else "eager"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    model_dir: str | Path, revision: str | None = None, token: str | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The model folder's tokenizer, to turn text into ``input_ids`` for training and ``generate``; or a hub id's
    (``ORG/NAME[@REVISION]``: its tokenizer files, fetched into the cache as swarm/hub.py does)."""
    from swarm.hub import resolve_model

    path = resolve_model(model_dir, revision, token).folder
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(
            f"{path}: no tokenizer ({' / '.join(TOKENIZER_FILES)}); copy the tokenizer files of the original model "
            "into it, or write the folder with `swarm convert-gguf FILE OUT_DIR`, which includes one"
        )
    return transformers.AutoTokenizer.from_pretrained(path)


def _weight_files(path: Path) -> dict[str, Path]:
    index = path / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelFolderError(
        f"{path}: neither {SINGLE_FILE} nor {SHARD_INDEX}; only safetensors checkpoints are supported"
    )
