"""swarm: LoRA fine-tuning of Llama-family models over a swarm of peer GPUs that come and go."""

from swarm.client.model import SwarmModelForCausalLM
from swarm.client.optimizer import RemoteOptimizer
from swarm.errors import (
    AdapterBusyError,
    AdapterConfigError,
    AdapterStateLostError,
    CommitError,
    LeaseLostError,
    ModelFolderError,
    RemoteError,
    SwarmAccessError,
    SwarmError,
    SwarmKeyError,
    SwarmUnavailableError,
)
from swarm.spec import load_tokenizer

__all__ = [
    "SwarmModelForCausalLM",
    "RemoteOptimizer",
    "SwarmError",
    "AdapterBusyError",
    "AdapterConfigError",
    "AdapterStateLostError",
    "CommitError",
    "LeaseLostError",
    "ModelFolderError",
    "RemoteError",
    "SwarmAccessError",
    "SwarmKeyError",
    "SwarmUnavailableError",
    "load_tokenizer",
]
__version__ = "0.1.0"
