"""Checkpoints of LoRA + AdamW state: round trips, corruption and crash fallbacks, the background writer."""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import pytest
import torch

from peers import checkpoints
from peers.checkpoints import CheckpointStore, CheckpointWriter
from peers.state import BlockState

META = {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "seed": 7}


def make_state(step: int, seed: int = 0) -> BlockState:
    """Two LoRA tensors with AdamW moments (one bf16) and one without moments, as before a first step."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tensors = {}
    for name, dtype in (
        ("self_attn.q_proj.lora_A.weight", torch.float32),
        ("mlp.up_proj.lora_B.weight", torch.bfloat16),
    ):
        tensors[name] = {
            "param": torch.randn(4, 8, generator=g).to(dtype),
            "exp_avg": torch.randn(4, 8, generator=g).to(dtype),
            "exp_avg_sq": torch.rand(4, 8, generator=g).to(dtype),
            "step": torch.tensor(float(step)),
        }
    tensors["self_attn.v_proj.lora_A.weight"] = {"param": torch.randn(4, 8, generator=g)}
    return BlockState(step=step, tensors=tensors)


def assert_same(a: BlockState, b: BlockState) -> None:
    assert a.step == b.step
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].keys() == b.tensors[name].keys()
        for key, t in a.tensors[name].items():
            u = b.tensors[name][key]
            assert u.dtype == t.dtype and u.shape == t.shape and u.device.type == "cpu"
            assert torch.equal(u.view(torch.uint8) if u.dim() else u, t.view(torch.uint8) if t.dim() else t)


def block_file(store: CheckpointStore, adapter: str, block: int) -> Path:
    return store.adapter_dir(adapter) / f"block-{block:05d}.safetensors"


def test_round_trip_of_several_adapters_and_blocks(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.load() == {}
    saved = {
        "team/alpha v1": {0: make_state(3, 1), 1: make_state(3, 2), 12: make_state(5, 3)},
        "plain": {2: make_state(1)},
    }
    for adapter, states in saved.items():
        for block, state in states.items():
            store.save_block(adapter, block, state, {**META, "adapter": adapter})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["plain", "team%2Falpha%20v1"]
    loaded = store.load()
    assert loaded.keys() == saved.keys()
    for adapter, states in saved.items():
        meta, got = loaded[adapter]
        assert meta == {**META, "adapter": adapter}
        assert got.keys() == states.keys()
        for block, state in states.items():
            assert_same(state, got[block])
    assert store.steps() == {"team/alpha v1": {0: 3, 1: 3, 12: 5}, "plain": {2: 1}}
    assert store.blocks() == {0, 1, 2, 12}
    assert CheckpointStore(tmp_path / "nothing here").blocks() == set()


def test_the_state_before_the_last_apply_is_kept_and_checked(tmp_path):
    """A peer restarted from its checkpoint can take back the step its last commit applied, as it could before it
    died: the file keeps the state before that apply, under the same checksum."""
    store = CheckpointStore(tmp_path / "ckpt")
    state = make_state(4, 1)
    state.before = make_state(3, 1)
    store.save_block("a", 0, state, META)
    store.save_block("a", 1, make_state(4, 2), META)  # committed long ago: nothing to take back
    _, got = store.load()["a"]
    assert_same(state, got[0])
    assert_same(state.before, got[0].before)
    assert got[1].before is None
    path = block_file(store, "a", 0)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"before_step":"3"', b'"before_step":"2"'))
    assert path.read_bytes() != data
    assert not checkpoints._prev(path).exists()  # no older generation to fall back to
    assert 0 not in store.load()["a"][1], "a tampered step before is caught by the checksum"


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_refuses_names_that_are_no_directory(tmp_path, name):
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path).save_block(name, 0, make_state(1), META)


def flip_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 + header_len + 5] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-20])


@pytest.mark.parametrize("corrupt, reason", [(flip_tensor_byte, "checksum mismatch"), (truncate, "unusable")])
def test_corrupt_current_file_falls_back_to_previous(tmp_path, caplog, corrupt, reason):
    store = CheckpointStore(tmp_path)
    first, second = make_state(1), make_state(2)
    store.save_block("a", 0, first, META)
    store.save_block("a", 1, first, META)
    path = store.save_block("a", 0, second, META)
    assert path == block_file(store, "a", 0)
    assert path.with_name(path.name + ".prev").exists()
    assert_same(second, store.load()["a"][1][0])
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger="peers.checkpoints"):
        meta, states = store.load()["a"]
    assert meta == META
    assert_same(first, states[0])
    assert_same(first, states[1])
    assert any(
        r.levelno == logging.WARNING and reason in r.getMessage() and "previous generation" in r.getMessage()
        for r in caplog.records
    )


def test_block_with_both_generations_bad_is_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save_block("a", 0, make_state(step), META)
    store.save_block("a", 1, make_state(2), META)
    path = block_file(store, "a", 0)
    flip_tensor_byte(path)
    truncate(path.with_name(path.name + ".prev"))
    with caplog.at_level(logging.ERROR, logger="peers.checkpoints"):
        assert store.steps() == {"a": {1: 2}}
    assert any(r.levelno == logging.ERROR and "block skipped" in r.getMessage() for r in caplog.records)


def test_interrupted_write_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    first = make_state(1)
    store.save_block("a", 0, first, META)

    def write_half(self, path: Path, data: bytes) -> None:
        path.write_bytes(data[: len(data) // 2])
        raise OSError("disk gone")

    monkeypatch.setattr(CheckpointStore, "_write_tmp", write_half)
    with pytest.raises(OSError, match="disk gone"):
        store.save_block("a", 0, make_state(2), META)
    assert_same(first, store.load()["a"][1][0])
    assert [p.name for p in store.adapter_dir("a").iterdir()] == ["block-00000.safetensors"]


def test_leftover_temp_file_is_discarded(tmp_path, caplog):
    """What a SIGKILL during _write_tmp leaves: a partial temp file next to the intact checkpoint."""
    store = CheckpointStore(tmp_path)
    first = make_state(1)
    path = store.save_block("a", 0, first, META)
    tmp = path.with_name(path.name + ".tmp-12345-0")
    tmp.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="peers.checkpoints"):
        assert_same(first, store.load()["a"][1][0])
    assert not tmp.exists()
    assert f"discarding an interrupted checkpoint write: {tmp}" in caplog.messages


def test_a_look_at_the_steps_leaves_a_write_in_progress_alone(tmp_path):
    """Another process (a test, an operator's script) reading a live peer's directory cannot tell its write in
    progress from an interrupted one: deleting the temp file lost that write, and the block stayed a step behind."""
    store = CheckpointStore(tmp_path)
    path = store.save_block("a", 0, make_state(1), META)
    tmp = path.with_name(path.name + ".tmp-12345-0")
    tmp.write_bytes(path.read_bytes())
    assert CheckpointStore(tmp_path).steps() == {"a": {0: 1}}
    assert tmp.exists()


def test_kill_between_the_two_renames_loads_previous(tmp_path, monkeypatch, caplog):
    store = CheckpointStore(tmp_path)
    first = make_state(1)
    path = store.save_block("a", 0, first, META)
    real_replace = os.replace

    class Killed(BaseException):
        pass

    def replace(src, dst):
        if checkpoints._TMP in Path(src).name:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(checkpoints.os, "replace", replace)
    with pytest.raises(Killed):
        store.save_block("a", 0, make_state(2), META)
    monkeypatch.undo()
    assert not path.exists() and path.with_name(path.name + ".prev").exists()
    with caplog.at_level(logging.WARNING, logger="peers.checkpoints"):
        assert_same(first, store.load()["a"][1][0])
    assert any("is missing" in m and "previous generation" in m for m in caplog.messages)
    # the next save does not rotate the missing current file over the good previous one
    store.save_block("a", 0, make_state(3), META)
    assert store.steps() == {"a": {0: 3}}


class RecordingStore(CheckpointStore):
    """Records each write; the first write can be held until released, and chosen blocks fail."""

    def __init__(self, root: Path, hold_first: bool = False, failing: frozenset[int] = frozenset()):
        super().__init__(root)
        self.calls: list[tuple[str, int, int]] = []
        self.writing = threading.Event()  # set once the writer thread is inside its first write
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.failing = set(failing)

    def save_block(self, adapter: str, block: int, state: BlockState, meta: dict) -> Path:
        self.writing.set()
        self.release.wait(10)
        self.calls.append((adapter, block, state.step))
        if block in self.failing:
            raise OSError(f"cannot write block {block}")
        return super().save_block(adapter, block, state, meta)


def test_writer_coalesces_pending_states(tmp_path, caplog):
    store = RecordingStore(tmp_path, hold_first=True)
    writer = CheckpointWriter(store)
    try:
        with caplog.at_level(logging.INFO, logger="peers.checkpoints"):
            writer.submit("a", META, {0: make_state(0)})
            assert store.writing.wait(10)  # the writer holds step 0: what follows can only coalesce behind it
            for step in range(1, 6):
                writer.submit("a", META, {0: make_state(step)})
            assert writer.flush(0.1) is False  # the first write is held
            store.release.set()
            assert writer.flush(10) is True
    finally:
        assert writer.close(10)
    assert store.calls == [("a", 0, 0), ("a", 0, 5)]
    assert writer.written == {("a", 0): 5}
    assert_same(make_state(5), store.load()["a"][1][0])
    assert any("checkpoint of adapter 'a' blocks [0] at step 5 written to" in m for m in caplog.messages)


def test_writer_every_skips_steps_and_restarts_after_a_reset(tmp_path):
    store = RecordingStore(tmp_path)
    writer = CheckpointWriter(store, every=3)
    for step in [*range(1, 8), 2]:
        writer.submit("a", META, {0: make_state(step), 1: make_state(step)})
        assert writer.flush(10)
    writer.close(10)
    assert [step for _, block, step in store.calls if block == 0] == [1, 4, 7, 2]
    assert store.steps() == {"a": {0: 2, 1: 2}}


def test_writer_logs_errors_and_retries_the_failed_block(tmp_path, caplog):
    store = RecordingStore(tmp_path, failing=frozenset({1}))
    writer = CheckpointWriter(store, every=5)
    with caplog.at_level(logging.ERROR, logger="peers.checkpoints"):
        writer.submit("a", META, {0: make_state(1), 1: make_state(1)})
        assert writer.flush(10)
    assert writer.written == {("a", 0): 1}
    assert any("block 1 at step 1 failed" in r.getMessage() and r.exc_info for r in caplog.records)
    store.failing.clear()
    writer.submit("a", META, {0: make_state(2), 1: make_state(2)})  # block 0 is not due, block 1 is retried
    assert writer.close(10)
    assert writer.written == {("a", 0): 1, ("a", 1): 2}
    assert store.steps() == {"a": {0: 1, 1: 2}}


def test_close_writes_what_is_pending_and_later_submits_are_dropped(tmp_path, caplog):
    store = RecordingStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.submit("a", META, {3: make_state(4)})
    assert writer.close(10)
    assert store.steps() == {"a": {3: 4}}
    with caplog.at_level(logging.WARNING, logger="peers.checkpoints"):
        writer.submit("a", META, {3: make_state(5)})
    assert "closed" in caplog.text
    assert store.steps() == {"a": {3: 4}}
