"""swarm: LoRA fine-tuning of Llama-family models over a swarm of peer GPUs that come and go.

The client's names load on first use, so that a peer daemon or a bootstrap node importing ``swarm.net`` does not
import the client (and ``swarm.testing`` is never on anyone's import path but tests', scripts' and the demo's).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from swarm.quiet import silence_third_party

silence_third_party()  # before anything imports bitsandbytes

from swarm.net.errors import (  # noqa: E402
    AdapterBusyError,
    AdapterConfigError,
    AdapterStateLostError,
    CommitError,
    IdentityInUseError,
    LeaseLostError,
    ModelFolderError,
    ModelHubError,
    RemoteError,
    ReplicasDisagreeError,
    SwarmAccessError,
    SwarmError,
    SwarmKeyError,
    SwarmUnavailableError,
    WeightsMismatchError,
)

if TYPE_CHECKING:
    from swarm.client.config import SwarmConfig
    from swarm.client.model import SwarmModelForCausalLM
    from swarm.client.optimizer import RemoteOptimizer
    from swarm.client.sft import SwarmSFTTrainer
    from swarm.client.trainer import SwarmTrainer
    from swarm.spec import load_tokenizer

_LAZY = {
    "SwarmModelForCausalLM": "swarm.client.model",
    "SwarmConfig": "swarm.client.config",
    "RemoteOptimizer": "swarm.client.optimizer",
    "SwarmTrainer": "swarm.client.trainer",
    "SwarmSFTTrainer": "swarm.client.sft",  # imports trl: only when used
    "load_tokenizer": "swarm.spec",
}

__all__ = [
    "SwarmModelForCausalLM",
    "SwarmConfig",
    "RemoteOptimizer",
    "SwarmTrainer",
    "SwarmSFTTrainer",
    "SwarmError",
    "AdapterBusyError",
    "AdapterConfigError",
    "AdapterStateLostError",
    "CommitError",
    "LeaseLostError",
    "ModelFolderError",
    "ModelHubError",
    "RemoteError",
    "IdentityInUseError",
    "ReplicasDisagreeError",
    "SwarmAccessError",
    "SwarmKeyError",
    "SwarmUnavailableError",
    "WeightsMismatchError",
    "load_tokenizer",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
