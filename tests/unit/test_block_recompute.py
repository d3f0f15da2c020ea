"""A peer's training backward recomputes one block at a time from the block inputs its forward kept (peers/backend.py):
the same bits as a backward through the whole span's graph, dropout or not, at about one block's graph of saved
activations whatever the span's length."""

from __future__ import annotations

import weakref

import peft
import pytest
import torch

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from swarm.blocks import lora_config_to_wire
from swarm.dropout import dropout_masks
from swarm.net.errors import MissingForwardError
from swarm.spec import load_spec
from swarm.testing.tiny import make_tiny_model

BLOCKS = 8
TARGETS = ["q_proj", "v_proj", "up_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("recompute") / "tiny-llama", "llama", layers=BLOCKS, seed=1)


def _backend(model_dir, blocks: range, dropout: float) -> SpanBackend:
    spec = load_spec(model_dir)
    backend = SpanBackend(spec, blocks, torch.device("cpu"), torch.float32, "none", AdapterStore(spec))
    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout))
    backend.adapters.open_adapter("a", wire, seed=3, session="s")
    with torch.no_grad():  # B is zero at init: give every LoRA tensor a gradient and an effect on the outputs
        for state in backend.adapters.adapter("a").blocks.values():
            for lp in state.params:
                lp.param.normal_(generator=torch.Generator().manual_seed(1)).mul_(0.1)
    return backend


def _params(backend: SpanBackend, blocks: range) -> list[torch.Tensor]:
    states = backend.adapters.adapter("a").blocks
    return [lp.param for block in blocks for lp in states[block].params]


def _whole_span(backend, blocks, mb, hidden, mask, grad_out) -> list[torch.Tensor]:
    """The reference: the whole span's graph, as peers built it before, back-propagated at once."""
    backend._activate("a")
    inputs = hidden.clone().requires_grad_(True)
    with torch.enable_grad(), dropout_masks(backend.adapters.adapter("a").seed, mb):
        outputs = backend.run(inputs, mask, blocks)
    return list(torch.autograd.grad(outputs, [inputs, *_params(backend, blocks)], grad_out))


def _held(backend, blocks, mb) -> list[torch.Tensor]:
    states = backend.adapters.adapter("a").blocks
    return [g for block in blocks for g in states[block].grads.pop(mb)]


def _inputs(seed: int, padded: bool):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, 64, generator=generator)
    grad_out = torch.randn(2, 7, 64, generator=generator)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]) if padded else None
    return hidden, mask, grad_out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("padded", [False, True])
def test_per_block_recompute_gives_the_whole_spans_bits(model_dir, dropout, padded):
    blocks = range(0, BLOCKS)
    backend = _backend(model_dir, blocks, dropout)
    hidden, mask, grad_out = _inputs(0, padded)
    reference = _whole_span(backend, blocks, "s:0:1", hidden, mask, grad_out)
    assert all(g.abs().sum() > 0 for g in reference)

    # from the block inputs the forward cached
    outputs = backend.forward("a", blocks, 0, hidden, mask, "s:0:1")
    assert backend.adapters.cache.bytes == BLOCKS * hidden.nbytes + (0 if mask is None else mask.nbytes)
    grad_in = backend.backward("a", blocks, 0, "s:0:1", None, None, grad_out)
    assert backend.adapters.cache.bytes == 0
    assert _equal([grad_in, *_held(backend, blocks, "s:0:1")], reference)
    with torch.no_grad(), dropout_masks(3, "s:0:1"):
        assert torch.equal(outputs, backend.run(hidden, mask, blocks)), "the forward's outputs changed"

    # the cache dropped them (its bound, a restart): rebuilt from the kept span input
    backend.forward("a", blocks, 0, hidden, mask, "s:0:1")
    backend.adapters.cache.drop_adapter("a")
    grad_in = backend.backward("a", blocks, 0, "s:0:1", None, None, grad_out)
    assert _equal([grad_in, *_held(backend, blocks, "s:0:1")], reference)

    # no forward here: the input sent with the backward; and no input gradient asked for
    grad_in = backend.backward("a", blocks, 0, "s:0:1", hidden, mask, grad_out, input_grad=False)
    assert grad_in is None and _equal(_held(backend, blocks, "s:0:1"), reference[1:])
    if dropout:
        other = _whole_span(backend, blocks, "s:0:2", hidden, mask, grad_out)
        assert not torch.equal(other[1], reference[1]), "dropout drew no masks"


def test_a_sub_span_and_a_single_block_recompute_exactly(model_dir):
    backend = _backend(model_dir, range(0, BLOCKS), 0.3)
    hidden, mask, grad_out = _inputs(1, padded=True)
    for blocks in (range(3, 4), range(2, 6)):
        reference = _whole_span(backend, blocks, "s:0:3", hidden, mask, grad_out)
        backend.forward("a", blocks, 0, hidden, mask, "s:0:3")
        grad_in = backend.backward("a", blocks, 0, "s:0:3", None, None, grad_out)
        assert _equal([grad_in, *_held(backend, blocks, "s:0:3")], reference)


def test_per_block_recompute_under_the_clients_autocast_gives_the_whole_spans_bits(model_dir):
    blocks = range(0, 4)
    backend = _backend(model_dir, blocks, 0.3)
    hidden, mask, grad_out = _inputs(4, padded=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = _whole_span(backend, blocks, "s:0:6", hidden, mask, grad_out)
    backend.forward("a", blocks, 0, hidden, mask, "s:0:6", autocast="bfloat16")
    grad_in = backend.backward("a", blocks, 0, "s:0:6", None, None, grad_out, autocast="bfloat16")
    assert _equal([grad_in, *_held(backend, blocks, "s:0:6")], [reference[0].float(), *reference[1:]])


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe"])
def test_per_block_recompute_gives_the_whole_spans_bits_in_other_families(tmp_path, family):
    """Sliding-window and global attention blocks with their own rotary bases (masks built per block as for the
    span), and mixtures of experts."""
    blocks = range(0, 4)
    backend = _backend(make_tiny_model(tmp_path / family, family, layers=4, seed=1), blocks, 0.3)
    hidden, mask, grad_out = _inputs(5, padded=True)
    reference = _whole_span(backend, blocks, "s:0:7", hidden, mask, grad_out)
    backend.forward("a", blocks, 0, hidden, mask, "s:0:7")
    grad_in = backend.backward("a", blocks, 0, "s:0:7", None, None, grad_out)
    assert _equal([grad_in, *_held(backend, blocks, "s:0:7")], reference)


def test_a_backward_without_any_input_is_refused(model_dir):
    backend = _backend(model_dir, range(0, 2), 0.0)
    _, _, grad_out = _inputs(2, padded=False)
    with pytest.raises(MissingForwardError):
        backend.backward("a", range(0, 2), 0, "s:0:4", None, None, grad_out)


class LiveSaved:
    """The bytes autograd holds for backward at any moment (each storage once, the blocks' weights left out), and
    their peak: saved tensors are counted while their graph node keeps them."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.counts, self.bytes, self.peak = exclude, {}, 0, 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda holder: holder.tensor)

    class Holder:
        def __init__(self, tensor: torch.Tensor):
            self.tensor = tensor

    def pack(self, tensor: torch.Tensor):
        holder = self.Holder(tensor.detach())  # detached: a saved output must not keep its own node alive
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.exclude:
            if self.counts.get(pointer, 0) == 0:
                self.bytes += storage.nbytes()
                self.peak = max(self.peak, self.bytes)
            self.counts[pointer] = self.counts.get(pointer, 0) + 1
            weakref.finalize(holder, self.unpacked, pointer, storage.nbytes())
        return holder

    def unpacked(self, pointer: int, size: int) -> None:
        self.counts[pointer] -= 1
        if self.counts[pointer] == 0:
            self.bytes -= size


def _peaks(model_dir, span: int) -> tuple[int, int]:
    """Peak bytes saved for backward over a training forward and backward of ``span`` blocks: through the whole
    span's graph (as before), and per block (as now)."""
    blocks = range(0, span)
    backend = _backend(model_dir, blocks, 0.3)
    weights = {
        t.untyped_storage().data_ptr()
        for layer in backend.layers.values()
        for t in (*layer.parameters(), *layer.buffers())
    }
    hidden, mask, grad_out = _inputs(3, padded=True)
    whole = LiveSaved(weights)
    with whole.hooks:
        _whole_span(backend, blocks, "s:0:5", hidden, mask, grad_out)
    per_block = LiveSaved(weights)
    with per_block.hooks:
        backend.forward("a", blocks, 0, hidden, mask, "s:0:5")
        backend.backward("a", blocks, 0, "s:0:5", None, None, grad_out)
    assert whole.bytes == 0 and per_block.bytes == 0, "a graph outlived its backward"
    return whole.peak, per_block.peak


def test_saved_activations_peak_at_one_blocks_graph_whatever_the_span(model_dir):
    whole_one, per_block_one = _peaks(model_dir, 1)
    whole_two, per_block_two = _peaks(model_dir, 2)
    whole_eight, per_block_eight = _peaks(model_dir, BLOCKS)
    print(
        f"peak saved bytes: whole span 1/2/8 blocks {whole_one}/{whole_two}/{whole_eight}, "
        f"per block {per_block_one}/{per_block_two}/{per_block_eight}"
    )
    assert whole_eight > 6 * whole_one  # the whole span's graph grows with the span
    assert per_block_one <= whole_one and per_block_eight <= 1.25 * per_block_one
    assert per_block_two <= 1.25 * per_block_one
