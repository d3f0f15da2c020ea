"""A block's error in a peer's numerics against exact fp32 (peers/calibration.py): measured with the fp32 reference in
host memory (never beside the served span on its device), the same for every peer of one class."""

from __future__ import annotations

import torch

from peers.calibration import block_error
from swarm.blocks import load_block
from swarm.spec import load_spec


def test_a_bf16_block_is_measured_against_fp32_on_the_host(tiny_models):
    spec = load_spec(tiny_models["llama"])
    served = load_block(spec, 1, torch.device("cpu"), torch.bfloat16, "none")
    before = {name: t.clone() for name, t in served.state_dict().items()}
    error = block_error(spec, 1, served, torch.device("cpu"), torch.bfloat16)
    assert 1e-4 < error < 0.1  # bf16's rounding, seen through the probe
    assert error == block_error(spec, 1, served, torch.device("cpu"), torch.bfloat16)  # seeded: a class agrees
    assert all(torch.equal(before[name], t) for name, t in served.state_dict().items())  # the probe ran on a copy
    exact = load_block(spec, 1, torch.device("cpu"), torch.float32, "none")
    assert block_error(spec, 1, exact, torch.device("cpu"), torch.float32) == 0.0
