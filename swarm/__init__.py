"""swarm: LoRA fine-tuning of Llama-family models over a swarm of peer GPUs that come and go."""

from swarm.client.model import SwarmModelForCausalLM
from swarm.client.optimizer import RemoteOptimizer

__all__ = ["SwarmModelForCausalLM", "RemoteOptimizer"]
__version__ = "0.1.0"
