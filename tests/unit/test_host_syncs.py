"""The peer's hot path waits for its device a fixed few times per micro-batch and per commit, however many blocks
and LoRA tensors its span holds (issue 60, item 4): each wait stalls a GPU's stream. Counted three ways on the CPU:
scalar reads through torch's dispatcher (``float()``, ``.item()``, ``bool()`` of a tensor), calls of
``.cpu()``/``.numpy()``/``.tolist()``, and swarm/net/hostsync.py's own counts."""

from __future__ import annotations

from collections import Counter

import peft
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.commits import Commits
from peers.reduction.reports import GradReports
from swarm.blocks import lora_config_to_wire
from swarm.net import hostsync
from swarm.net.protocol import OptimizerHParams
from swarm.spec import load_spec

HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
MICRO_BATCHES = 3


class _ScalarReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``aten::_local_scalar_dense``: a sync on a GPU)."""

    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen["scalar reads"] += 1
        return func(*args, **(kwargs or {}))


def _counting(monkeypatch: pytest.MonkeyPatch, seen: Counter[str]) -> None:
    """Count every ``.cpu()``, ``.numpy()`` and ``.tolist()`` of a tensor into ``seen``."""
    for method in ("cpu", "numpy", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, **kwargs):
            seen["host calls"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)


def _step(model_dir, blocks: range, r: int, targets: list[str], monkeypatch) -> tuple[Counter[str], Counter[str]]:
    """One step of ``MICRO_BATCHES`` micro-batches through a span, then its commit, as the service runs them
    (peers/service.py ``_backward`` and ``_commit``): the round trips per micro-batch (the last one's) and the
    commit's."""
    spec = load_spec(model_dir)
    backend = SpanBackend(spec, blocks, torch.device("cpu"), torch.float32, "none", AdapterStore(spec))
    store = backend.adapters
    reports = GradReports(store)
    wire = lora_config_to_wire(peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    store.open_adapter("a", wire, seed=3, session="s")
    per_mb, per_commit = Counter(), Counter()
    mbs = [f"s:0:{i:09d}" for i in range(MICRO_BATCHES)]
    for i, mb in enumerate(mbs):
        hidden = torch.randn(1, 6, spec.hidden_size, generator=torch.Generator().manual_seed(i))
        per_mb.clear()
        with monkeypatch.context() as patch, _ScalarReads(per_mb), hostsync.counted() as ours:
            _counting(patch, per_mb)
            backend.forward("a", blocks, 0, hidden, None, mb)
            backend.backward("a", blocks, 0, mb, None, None, torch.ones_like(hidden), False)
            reports.grad_norms("a", blocks, 0)
            reports.grad_hashes("a", blocks, 0, mb)
        per_mb.update(ours)
    with monkeypatch.context() as patch, _ScalarReads(per_commit), hostsync.counted() as ours:
        _counting(patch, per_commit)
        Commits(store).apply("a", 0, {b: [tuple(mbs)] for b in blocks}, HPARAMS, grad_scale=0.5)
        store.digests("a")
    per_commit.update(ours)
    assert store.adapter("a").steps() == dict.fromkeys(blocks, 1)
    return per_mb, per_commit


def test_a_micro_batch_and_a_commit_wait_for_the_device_a_fixed_few_times_whatever_the_span(tiny_models, monkeypatch):
    model = tiny_models["llama"]
    shapes = [
        (range(0, 2), 4, ["q_proj", "v_proj"]),
        (range(0, 4), 4, ["q_proj", "v_proj"]),
        (range(0, 4), 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ]
    counts = [_step(model, blocks, r, targets, monkeypatch) for blocks, r, targets in shapes]
    per_mb, per_commit = counts[0]
    # a micro-batch: its forward's output handed on (1 copy); the backward's reply: every block's norms (1 sync: one
    # .tolist()) and gradient hashes (1 copy: one .numpy() of them flat); the forward's and the backward's inputs
    # checked finite on the host, where the wire brought them (3 reads, no device's)
    assert per_mb == Counter({"scalar reads": 3, "host calls": 2, "syncs": 1, "copies": 2}), per_mb
    # a commit: every block's gradient finite and its moments' steps (1 sync each), the states before and their
    # digests, the update and the digests after (1 copy each)
    assert per_commit == Counter({"host calls": 4, "syncs": 2, "copies": 4}), per_commit
    assert all(c == counts[0] for c in counts), counts
