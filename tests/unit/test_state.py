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


def test_the_state_before_the_last_apply_travels_with_the_state():
    """A copy of a block made while its last apply may still be taken back carries the state before it, so the copy
    can take the step back too; a block without LoRA tensors keeps its step before as well."""
    before = BlockState(4, {"a.lora_A.weight": {"param": torch.randn(4, 8), "exp_avg": torch.randn(4, 8)}})
    after = BlockState(5, {"a.lora_A.weight": {"param": torch.randn(4, 8), "exp_avg": torch.randn(4, 8)}}, before)
    bare = BlockState(5, {}, BlockState(4, {}))
    back = unpack_states(*pack_states({0: after, 1: bare, 2: BlockState(5, {})}))
    assert back[0].step == 5 and back[0].before is not None and back[0].before.step == 4
    for key, tensor in after.tensors["a.lora_A.weight"].items():
        assert torch.equal(back[0].tensors["a.lora_A.weight"][key], tensor)
        assert torch.equal(back[0].before.tensors["a.lora_A.weight"][key], before.tensors["a.lora_A.weight"][key])
    assert back[0].before.before is None
    assert (back[1].step, back[1].tensors, back[1].before.step, back[1].before.tensors) == (5, {}, 4, {})
    assert back[2].before is None


def test_a_state_kept_in_bf16_has_a_digest_and_fp32_digests_are_the_raw_bytes():
    """Digests hash raw bytes: LoRA kept in bf16 (numpy has no bfloat16) is hashed too, and an fp32 state's digest
    is the sha256 over the same bytes as before (digests on disk and on the wire stay valid)."""
    import hashlib

    param = torch.randn(2, 3)
    fp32 = BlockState(4, {"q": {"param": param, "step": torch.tensor(4.0)}})
    expected = hashlib.sha256(b"4")
    for chunk in (b"q", param.numpy().tobytes(), b"step", torch.tensor(4.0).numpy().tobytes()):
        expected.update(chunk)
    assert fp32.digest() == expected.hexdigest()
    bf16 = BlockState(4, {"q": {"param": param.bfloat16(), "step": torch.tensor(4.0)}})
    assert bf16.digest() != fp32.digest()
