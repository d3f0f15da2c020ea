"""The names of the precisions a peer keeps its base weights in, without importing torch: the command line lists
and checks them before any heavy import (``swarm dht`` and ``swarm status`` never import torch's model stack)."""

from __future__ import annotations

QUANT_MODES = ("none", "int8", "nf4")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
