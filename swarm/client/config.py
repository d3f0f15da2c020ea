"""What a client is told beyond the model and its peers: every option of ``SwarmModelForCausalLM.from_pretrained`` as
one frozen value, checked once when it is made, and the parts of the client that each option reaches."""

from __future__ import annotations

import dataclasses
import getpass
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peft
import torch

from swarm.client.calls import CallHook
from swarm.client.commit import LOST_GRACE
from swarm.client.routing import RouterOptions
from swarm.net.compression import WireFormat
from swarm.net.errors import AdapterConfigError, RequestError
from swarm.net.protocol import check_adapter_name

RESUME_MODES = ("committed", "latest")


@dataclass(frozen=True)
class SwarmConfig:
    """The options of ``SwarmModelForCausalLM.from_pretrained`` beyond ``model_dir`` and ``initial_peers``, under
    the same names, with the same defaults and meaning (its docstring and docs/client-api.md document each). Pass
    one as ``from_pretrained(model_dir, initial_peers, config=SwarmConfig(...))`` to reuse it across clients."""

    adapter: str = "default"
    lora_config: peft.LoraConfig | None = None
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    seed: int = 0
    patience: float = 60.0
    trainer: str | None = None
    swarm_key: str | Path | None = None
    spot_check: float | None = None
    min_copies: int = 2
    resume: str = "committed"
    unreachable_wait: float = 30.0
    lost_grace: float = LOST_GRACE
    wire_dtype: str | None = None
    compression: str = "none"
    grad_compression: str | None = None
    is_trainable: bool = True
    chain: bool = True
    revision: str | None = None
    token: str | None = None
    call_hook: CallHook | None = None

    def __post_init__(self) -> None:
        if self.lora_config is None and self.is_trainable:
            raise ValueError("pass lora_config=peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...])")
        try:
            check_adapter_name(self.adapter)
        except RequestError as e:
            raise AdapterConfigError(str(e)) from None
        if self.resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {self.resume!r}")
        if self.min_copies < 1:
            raise ValueError(f"min_copies must be at least 1, got {self.min_copies}")
        self.wire  # noqa: B018 (an unknown wire_dtype or compression fails here, before anything is joined)

    @classmethod
    def given(cls, config: SwarmConfig | None, keywords: dict[str, Any]) -> SwarmConfig:
        """The configuration ``from_pretrained`` was given: ``config``, or else one made of its ``keywords`` (one per
        field). With a ``config``, every keyword must be left at its default: one set both ways is refused."""
        if config is None:
            return cls(**keywords)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        both = [name for name, value in keywords.items() if value is not defaults[name] and value != defaults[name]]
        if both:
            raise TypeError(
                f"from_pretrained got config=SwarmConfig(...) and the keywords {', '.join(both)}: pass each option "
                "once, in the config (dataclasses.replace(config, ...)) or as a keyword"
            )
        return config

    @property
    def wire(self) -> WireFormat:
        """How hidden states and their gradients travel: a bf16 model's in bf16 unless told (they are bf16 already:
        no rounding is added, half the bytes)."""
        wire_dtype = self.wire_dtype
        if wire_dtype is None and self.dtype == torch.bfloat16:
            wire_dtype = "bfloat16"
        return WireFormat(wire_dtype, self.compression, self.grad_compression)

    def trainer_name(self) -> str | None:
        """Who holds the adapter's lease: ``trainer``, else user@host; None for a reader (``is_trainable=False``)."""
        if not self.is_trainable:
            return None
        return self.trainer or f"{getpass.getuser()}@{socket.gethostname()}"

    def router_options(self, hidden_size: int) -> RouterOptions:
        """What the router takes of this configuration, for a model of ``hidden_size``: a token's activations weigh
        ``hidden_size`` values of the wire's bytes on each link."""
        return RouterOptions(
            unreachable_wait=self.unreachable_wait,
            bytes_per_token=hidden_size * self.wire.value_bytes(self.dtype),
            chained=self.chain,
        )


OPTIONS = frozenset(f.name for f in dataclasses.fields(SwarmConfig))  # from_pretrained's keywords, but for the config
