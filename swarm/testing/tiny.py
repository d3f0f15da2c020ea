"""Write a small random Llama-family causal LM in Hugging Face folder format.

The model is saved as ``config.json`` plus sharded safetensors
(``model-0000i-of-0000K.safetensors`` and ``model.safetensors.index.json``) so
that sharded loading code paths get exercised in tests and benchmarks.

Usage::

    python -m swarm.testing.tiny OUT_DIR [--family llama|mistral|qwen2|qwen3|olmo2|phi3|gemma2|gemma3_text|
        mixtral|qwen3_moe] \
        [--layers N] [--hidden H] [--heads N] [--kv-heads N] [--intermediate N] \
        [--vocab N] [--seed S] [--tie-embeddings] [--shard-size BYTES_OR_STR]

The module is importable too: see :func:`make_tiny_model`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

logger = logging.getLogger(__name__)

FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}
# Token ids as Llama's config has them: the other families' defaults (a pad or eos id of 32000 or 50279) lie outside
# a tiny vocabulary, or (Gemma's pad id 0) is a token of the tests' random ids, which transformers' generate would
# take for padding.
TOKEN_IDS = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}

MAX_POSITION_EMBEDDINGS = 512
# Default shard size is about a third of the model, so the default model
# always produces several shards; never go below this many bytes.
MIN_DEFAULT_SHARD_BYTES = 1024


def _validate(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
) -> None:
    """Raise ``ValueError`` with a hint on how to fix any bad argument."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of: {', '.join(sorted(FAMILIES))}")
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv-heads", kv_heads),
        ("intermediate", intermediate),
        ("vocab", vocab),
    ):
        if value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    if hidden % heads:
        raise ValueError(
            f"--hidden ({hidden}) must be divisible by --heads ({heads}); "
            f"pick a hidden size that is a multiple of {heads} or change --heads"
        )
    if heads % kv_heads:
        raise ValueError(
            f"--heads ({heads}) must be divisible by --kv-heads ({kv_heads}); "
            f"pick --kv-heads as a divisor of {heads} (e.g. 1 or {heads})"
        )
    if (hidden // heads) % 2:
        raise ValueError(
            f"head dim --hidden/--heads = {hidden // heads} must be even for "
            "rotary embeddings; change --hidden or --heads"
        )


GEMMA = ("gemma2", "gemma3_text")
# What makes a Gemma a Gemma, at a scale where each part shows in the logits: a sliding window shorter than the
# tests' sequences, soft-capping that bites on a tiny model's small logits and scores, a head_dim that is not
# hidden / heads and a query scaling that is not head_dim. Embeddings are tied, as in every Gemma.
GEMMA_SLIDING_WINDOW = 4
GEMMA_FINAL_SOFTCAP = 0.5
GEMMA_ATTN_SOFTCAP = 0.5


def _gemma_settings(family: str, layers: int, hidden: int, heads: int) -> dict[str, object]:
    head_dim = 2 * hidden // heads
    settings: dict[str, object] = {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim // 4,
        "sliding_window": GEMMA_SLIDING_WINDOW,
        "final_logit_softcapping": GEMMA_FINAL_SOFTCAP,
        "tie_word_embeddings": True,
    }
    if family == "gemma2":  # layers alternate sliding, full (Gemma 2's own default)
        settings["attn_logit_softcapping"] = GEMMA_ATTN_SOFTCAP
    else:  # every third layer global (Gemma 3's default is every sixth), with its own scaled rotary base
        settings["layer_types"] = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)]
        settings["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        }
    return settings


MOE = ("mixtral", "qwen3_moe")
# Mixture-of-experts at a tiny scale: 4 experts, each token to 2, experts a quarter of the dense width (Qwen3-MoE
# renormalises the top-2 weights, as Qwen3-30B-A3B does; Mixtral always does); Qwen3-MoE's first block is dense, as
# ``mlp_only_layers`` makes some, so that one peer's span holds both kinds.
MOE_EXPERTS = 4
MOE_TOP_K = 2
ROUTER_STD = 1.0


def _moe_settings(family: str, intermediate: int) -> dict[str, object]:
    settings: dict[str, object] = {"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}
    if family == "mixtral":
        settings["intermediate_size"] = intermediate // 4  # each expert's width
    else:
        settings.update(
            moe_intermediate_size=intermediate // 4, norm_topk_prob=True, mlp_only_layers=[0], use_sliding_window=False
        )
    return settings


def _spread_routers(model: torch.nn.Module, seed: int) -> None:
    """Routers initialised at std 0.02 give every expert nearly the same score on a tiny model: wider ones, so that
    which experts a token goes to is decided by a margin (and changes the output), not by rounding."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") and param.dim() == 2 and "experts" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * ROUTER_STD)


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Gemma initializes its norms' weights to 0 (they scale by 1 + weight): random ones, so that the norms count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def _model_bytes(model: torch.nn.Module) -> int:
    """Return the size in bytes of the model's unique (tied counted once) parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    seed: int = 0,
    tie_embeddings: bool = False,
    max_shard_size: str | int | None = None,
) -> Path:
    """Build a random float32 model of ``family`` and save it sharded to ``out_dir``.

    ``max_shard_size`` accepts bytes (int) or a string such as ``"200KB"``;
    when ``None`` it is about a third of the model size, giving >= 2 shards.
    Returns the output directory.
    """
    _validate(family, layers, hidden, heads, kv_heads, intermediate, vocab)
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**_config_kwargs(family, layers, hidden, heads, kv_heads, intermediate, vocab, tie_embeddings))

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.eval()
    if family in GEMMA:
        _perturb_norms(model, seed)
    if family in MOE:
        _spread_routers(model, seed)

    if max_shard_size is None:
        max_shard_size = max(_model_bytes(model) // 3, MIN_DEFAULT_SHARD_BYTES)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)

    _log_saved(model, family, tie_embeddings, out, max_shard_size)
    return out


def _config_kwargs(
    family: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool
) -> dict[str, object]:
    """The family's config at this size, with what each family needs beyond the common fields."""
    config_kwargs: dict[str, object] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
    }
    if family in ("qwen2", "qwen3"):
        config_kwargs["use_sliding_window"] = False
    if family == "qwen3":
        config_kwargs["head_dim"] = hidden // heads  # Qwen3's default is 128 whatever the hidden size
    if family in ("qwen3", "olmo2", "phi3", *GEMMA, *MOE):
        config_kwargs.update(TOKEN_IDS)
    if family == "qwen3_moe":
        config_kwargs["head_dim"] = hidden // heads  # Qwen3-MoE's default is 128, as Qwen3's
    if family in MOE:
        config_kwargs.update(_moe_settings(family, intermediate))
    if family in GEMMA:
        config_kwargs.update(_gemma_settings(family, layers, hidden, heads))
    return config_kwargs


def _log_saved(model, family: str, tie_embeddings: bool, out: Path, max_shard_size: str | int) -> None:
    n_shards = len(list(out.glob("model-*-of-*.safetensors")))
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "saved %s model (%d params, tied=%s) to %s in %d shard(s), max_shard_size=%s",
        family,
        n_params,
        tie_embeddings,
        out,
        n_shards,
        max_shard_size,
    )


CHAT_SPECIAL = ("<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
# A chat template whose assistant turns (their end-of-turn token included) are wrapped in {% generation %} markers:
# what TRL's SFTConfig(assistant_only_loss=True) needs to train on the assistant's tokens only.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|> {% generation %}{{ message['content'] }} <|end|>{% endgeneration %} "
    "{%- else -%}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|> {%- endif -%}"
)


def make_tiny_chat_tokenizer(out_dir: str | Path, vocab: int = 256) -> Path:
    """A word-level tokenizer for the tiny models: the chat's special tokens, then the words ``w7`` .. ``w{vocab-1}``
    (a word's id is its number), split on whitespace, with ``CHAT_TEMPLATE``. Saved to ``out_dir``."""
    words = {token: i for i, token in enumerate(CHAT_SPECIAL)}
    words.update({f"w{i}": i for i in range(len(CHAT_SPECIAL), vocab)})
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|end|>",
        additional_special_tokens=list(CHAT_SPECIAL[3:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def _shard_size(value: str) -> str | int:
    """Parse ``--shard-size``: plain digits are bytes, else a size string like 200KB."""
    return int(value) if value.isdigit() else value


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line arguments."""
    parser = argparse.ArgumentParser(description="Write a small random Llama-family model as sharded safetensors.")
    parser.add_argument("out_dir", type=Path, help="output folder")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="tie lm_head to the input embeddings",
    )
    parser.add_argument(
        "--shard-size",
        type=_shard_size,
        default=None,
        help="max shard size, bytes or e.g. '200KB' (default: about 1/3 of the model)",
    )
    return parser.parse_args(argv)


def make_bench_model(out_dir: str | Path, layers: int, hidden: int) -> Path:
    """The benchmarks' model: 8 heads, intermediate 11/4 of hidden, vocab 1024 (a small Llama's proportions)."""
    return make_tiny_model(
        out_dir, layers=layers, hidden=hidden, heads=8, kv_heads=8, intermediate=hidden * 11 // 4, vocab=1024
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints the output folder as the last line."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    try:
        out = make_tiny_model(
            args.out_dir,
            family=args.family,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            seed=args.seed,
            tie_embeddings=args.tie_embeddings,
            max_shard_size=args.shard_size,
        )
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    print(out)


if __name__ == "__main__":
    main()
