"""The model's own modules on the client: embeddings, final norm and LM head, the only tensors of the model it reads
(the blocks are the peers'), and what is computed with them: the stack's input, and logits and loss of its output."""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.spec import ModelSpec

NumItems = int | torch.Tensor | None

EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _read_tensors(spec: ModelSpec, names: list[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for path, group in spec.files_for(names).items():
        with safe_open(str(path), framework="pt") as f:
            for name in group:
                tensors[name] = f.get_tensor(name)
    return tensors


def autocast_dtype(device: torch.device | str) -> str | None:
    """The dtype the caller's autocast computes in on ``device`` (a Trainer's ``bf16``/``fp16`` turn it on around
    the forward), or None: the peers compute the blocks under the same autocast, as the local model would."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return None
    return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


class LocalModules(nn.Module):
    """Embeddings, final norm and LM head of ``spec``'s model in ``dtype`` on ``device``, frozen, read from the
    folder's shards; they compute as the family's own model does (Gemma's scaled embeddings, its soft-capping)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype, self.device = dtype, device
        config = spec.config
        self.vocab_size, self.logit_softcapping = config.vocab_size, spec.logit_softcapping
        names = [EMBEDDINGS, FINAL_NORM] + ([] if config.tie_word_embeddings else [LM_HEAD])
        tensors = _read_tensors(spec, names)
        self.embed_tokens = nn.Embedding.from_pretrained(tensors[EMBEDDINGS].to(dtype), freeze=True)
        self.norm = spec.family_class("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps).to(dtype)
        self.norm.weight = nn.Parameter(tensors[FINAL_NORM].to(dtype), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight = (
            self.embed_tokens.weight
            if config.tie_word_embeddings
            else nn.Parameter(tensors[LM_HEAD].to(dtype), requires_grad=False)
        )
        # Gemma's scaled embeddings: a float32 scalar cast to the embeddings' dtype at each forward, as its model does
        scale = spec.embed_scale
        self.register_buffer("embed_scale", None if scale is None else torch.tensor(scale), persistent=False)
        self.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings as the family's model computes them (Gemma: scaled by sqrt(hidden_size))."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale.to(self.embed_tokens.weight.dtype)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the last block's hidden states: final norm, LM head, and (Gemma) the final soft-capping."""
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        cap = self.logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def output(
        self, hidden: torch.Tensor, labels: torch.Tensor | None, num_items_in_batch: NumItems = None
    ) -> CausalLMOutputWithPast:
        """The causal LM's output of the last block's hidden states: logits, and with ``labels`` the loss, summed
        over the label tokens and divided by ``num_items_in_batch`` if given (else their mean), as transformers'."""
        logits = self.logits(hidden)
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(
                logits, labels.to(self.device), vocab_size=self.vocab_size, num_items_in_batch=num_items_in_batch
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
