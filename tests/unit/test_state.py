"""peers.state: adapter state packed into one tensor for the wire, and back."""

from __future__ import annotations

import pytest
import torch

from peers.state import BlockState, pack_states, unpack_states


def test_states_pack_into_one_tensor_and_back_exactly():
    states = {
        3: BlockState(2, {"a.lora_A.weight": {"param": torch.randn(4, 8).bfloat16(), "step": torch.tensor(2.0)}}),
        1: BlockState(5, {"b.lora_B.weight": {"param": torch.randn(8, 4), "exp_avg": torch.randn(8, 4)}}),
    }
    index, flat = pack_states(states)
    back = unpack_states(index, flat)
    assert {b: s.step for b, s in back.items()} == {3: 2, 1: 5}
    for block, state in states.items():
        for name, entry in state.tensors.items():
            for key, tensor in entry.items():
                assert back[block].tensors[name][key].dtype == tensor.dtype
                assert torch.equal(back[block].tensors[name][key], tensor)
    with pytest.raises(ValueError):
        unpack_states(index, flat[:-1])
