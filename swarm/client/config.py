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
    the same names, with the same defaults and meaning (documented here and in docs/client-api.md). Pass one as
    ``from_pretrained(model_dir, initial_peers, config=SwarmConfig(...))`` to reuse it across clients.

    ``adapter``: the adapter's name in the swarm; ``lora_config``, ``seed``: its LoRA (which fields are honoured:
    docs/limits-and-options.md) and init seed; ``dtype``, ``device``: the client's own modules' (embeddings, final
    norm, LM head); ``revision``, ``token``: a hub id's (``from_pretrained``'s ``model_dir``).
    ``patience``: seconds to wait when some blocks have no live server (or, on resume, no peer holding the
    adapter's committed step), or when no initial peer answers yet, before raising.
    ``min_copies``: ``opt.step()`` returns only once every block's new state is held by this many peers (live
    replicas plus standby copies), whenever the swarm has that many; fewer is warned about, never an error.
    ``resume``: ``"committed"`` waits for peers holding the adapter's committed step (as recorded in the swarm)
    and raises ``AdapterStateLostError`` if it is gone; ``"latest"`` accepts the newest state the peers still
    hold, and the steps lost are reported in ``model.steps_lost``.
    ``unreachable_wait``: how long a peer that stopped answering but may be alive (frozen, cut off) is waited
    for as the possible holder of the only current state of a block; a peer whose process is gone is not.
    ``lost_grace``: how long a block whose every current copy died (its peers' processes gone, no standby copy
    at the step) waits for them to restart from their checkpoints before its newest surviving copy, one step
    behind, is declared current; that step is lost and listed in ``model.steps_lost`` (a pause of the whole
    swarm costs more than one step of one span's updates). A survivor further behind is waited for up to half
    the ``patience``: restarting holders would bring those steps back.
    ``trainer``: who trains this adapter (default: user@host); the same trainer takes its lease back at once
    after a restart, another one waits for the lease to expire.
    ``swarm_key``: the key file of a private swarm (``swarm keygen``).
    ``spot_check``: fraction of micro-batches whose every hop is also computed on other replicas; a peer
    outvoted by two agreeing replicas is banned for good and listed in ``model.dishonest``. By default a public
    swarm (no ``swarm_key``) checks ``PUBLIC_SPOT_CHECK`` (3 %) of them wherever a span has three replicas, and a
    private one none; a rate given checks wherever a hop has another replica.
    ``wire_dtype`` (``"bfloat16"``, ``"float16"``) and ``compression`` (``"blockwise8"``, ``"hadamard4"``,
    ``"hadamard3"``, and ``"hadamard4sr"`` / ``"hadamard3sr"`` with stochastic rounding): how hidden states and
    their gradients travel; ``grad_compression``: the gradients' own, if they should differ (default: the same).
    All off by default (exact parity with local training), but a bf16 model's hidden states travel in bf16 (they
    are bf16 already). They cut the bytes per step by 2x / ~4x / ~7.5x / ~9.8x at the cost of rounding the
    activations (see BENCHMARKS.md for what that does to the loss). ``"hadamard4d3"`` (``...d4``, ``...d2``):
    for runs that see each sample more than once, a chained forward's hidden states travel as their change since
    the sample's last pass at 3 (4, 2) bits, a first pass at 4; client and peers keep each sample's last hidden
    states for that (at most 1 GiB each, ``swarm peer --delta-references-mb``); everything else goes as hadamard4.
    ``is_trainable=False`` (as in ``peft.PeftModel.from_pretrained``): a reader of an adapter that has committed
    steps, to ``generate`` or evaluate with its newest committed step while its trainer goes on training; it
    takes no lease and changes nothing on any peer. ``lora_config`` and ``seed`` then default to the adapter's.
    ``chain`` (default): hidden states pass from peer to peer, so the client sends a micro-batch in and gets the
    last span's output back, and its own link carries the same bytes whatever the number of spans; ``False``:
    every hop is a round trip from the client (client-driven hops).
    ``call_hook(peer, message, send)``: sees each request the client makes and returns its reply,
    ``send(message)``, with code before or after it (a test recording requests, or killing a peer at one:
    ``swarm.testing.faults.CallTap``); none by default.
    """

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
