"""Durable per-block checkpoints of LoRA adapters and their AdamW state, so a restarted peer resumes where it was."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import struct
import threading
from pathlib import Path
from urllib.parse import quote, unquote

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from peers.state import BlockState

logger = logging.getLogger(__name__)

_BLOCK_FILE = re.compile(r"block-(\d+)\.safetensors(\.prev)?")
_TMP = ".tmp-"


def _digest(
    tensors: dict[str, torch.Tensor], step: int, block: int, adapter: str, meta: str, before_step: int | None
) -> str:
    """Covers every tensor byte and every field read back, so truncation or bit rot cannot go unnoticed (files
    without a state before, as every file was before there were any, hash as they did)."""
    fields = [step, block, adapter, meta] + ([before_step] if before_step is not None else [])
    h = hashlib.sha256(json.dumps(fields).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """A rename is only durable once its directory is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prev(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


# What reading a torn, truncated or tampered checkpoint file raises.
UNUSABLE = (OSError, ValueError, KeyError, TypeError, struct.error, SafetensorError)


def _read(path: Path, adapter: str, block: int) -> tuple[dict, BlockState]:
    """One checkpoint file, verified against its checksum and against where it lies."""
    data = path.read_bytes()
    tensors = load_safetensors(data)
    (header_len,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + header_len])["__metadata__"]
    step, meta = int(metadata["step"]), metadata["meta"]
    before_step = int(metadata["before_step"]) if "before_step" in metadata else None
    if (metadata["adapter"], int(metadata["block"])) != (adapter, block):
        raise ValueError(f"it holds block {metadata['block']} of adapter {metadata['adapter']!r}")
    if _digest(tensors, step, block, adapter, meta, before_step) != metadata["sha256"]:
        raise ValueError("checksum mismatch")
    entries: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        name, field = key.rsplit("::", 1)
        entries.setdefault(name, {})[field] = tensors[key]
    return json.loads(meta), BlockState.from_fields(step, entries, before_step)


class CheckpointStore:
    """Files ``root/<quoted adapter>/block-NNNNN.safetensors``, one per block, each with one previous generation."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._inflight: set[Path] = set()  # temp files being written now, which load() must not take for leftovers

    def adapter_dir(self, adapter: str) -> Path:
        encoded = quote(adapter, safe="")
        if encoded in ("", ".", ".."):
            raise ValueError(f"adapter name {adapter!r} cannot name a checkpoint directory")
        return self.root / encoded

    def save_block(self, adapter: str, block: int, state: BlockState, meta: dict) -> Path:
        """Replace the block's file atomically: a crash at any instant leaves the current or the previous one whole."""
        directory = self.adapter_dir(adapter)
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            _fsync_dir(directory.parent)
        tensors = {
            f"{name}::{key}": t.detach().cpu().contiguous()
            for name, entry in state.fields().items()
            for key, t in entry.items()
        }
        meta_json = json.dumps(meta, sort_keys=True)
        metadata = {"format": "pt", "step": str(state.step), "block": str(block), "adapter": adapter, "meta": meta_json}
        before_step = state.before.step if state.before is not None else None
        if before_step is not None:
            metadata["before_step"] = str(before_step)
        metadata["sha256"] = _digest(tensors, state.step, block, adapter, meta_json, before_step)
        data = save_safetensors(tensors, metadata)
        path = directory / f"block-{block:05d}.safetensors"
        tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}-{next(self._counter)}")
        with self._lock:
            self._inflight.add(tmp)
        try:
            self._write_tmp(tmp, data)
            if path.exists():
                os.replace(path, _prev(path))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            with self._lock:
                self._inflight.discard(tmp)
        _fsync_dir(directory)
        return path

    def _write_tmp(self, path: Path, data: bytes) -> None:
        """Write and fsync the temp file; a method of its own so fault tests can interrupt it half-way."""
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def blocks(self) -> set[int]:
        """Blocks some adapter has a checkpoint file of (not read, not checked): where a restarted peer's state is."""
        if not self.root.is_dir():
            return set()
        return {
            int(match.group(1))
            for directory in self.root.iterdir()
            if directory.is_dir()
            for p in directory.iterdir()
            if (match := _BLOCK_FILE.fullmatch(p.name))
        }

    def load(self, discard_interrupted: bool = True) -> dict[str, tuple[dict, dict[int, BlockState]]]:
        """Adapter -> (meta, block -> newest intact state); deletes temp files left by interrupted writes (the peer
        that owns the directory, at its start; ``discard_interrupted=False``: a look from another process, which
        cannot tell an interrupted write from one in progress, and must not delete a live peer's)."""
        if not self.root.is_dir():
            return {}
        result = {}
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
            adapter = unquote(directory.name)
            if quote(adapter, safe="") != directory.name:
                logger.warning("ignoring %s: not a checkpoint directory", directory)
                continue
            blocks = set()
            for p in directory.iterdir():
                if _TMP in p.name:
                    if not discard_interrupted:
                        continue
                    with self._lock:
                        if p in self._inflight:
                            continue
                    logger.warning("discarding an interrupted checkpoint write: %s", p)
                    p.unlink(missing_ok=True)
                elif match := _BLOCK_FILE.fullmatch(p.name):
                    blocks.add(int(match.group(1)))
            metas, states = {}, {}
            for block in sorted(blocks):
                if loaded := self._load_block(directory / f"block-{block:05d}.safetensors", adapter, block):
                    metas[block], states[block] = loaded
            if states:
                if len({json.dumps(m, sort_keys=True) for m in metas.values()}) > 1:
                    logger.warning("blocks of adapter %r were saved with different meta: %s", adapter, metas)
                result[adapter] = (next(iter(metas.values())), states)
        return result

    def _load_block(self, path: Path, adapter: str, block: int) -> tuple[dict, BlockState] | None:
        """The current file if intact, else the previous generation, else None; every fallback is logged."""
        try:
            return _read(path, adapter, block)
        except UNUSABLE as e:
            problem = "is missing" if isinstance(e, FileNotFoundError) else f"is unusable ({e!r})"
        try:
            meta, state = _read(_prev(path), adapter, block)
        except UNUSABLE as e:
            logger.error("checkpoint %s %s and so is its previous generation (%r): block skipped", path, problem, e)
            return None
        logger.warning(
            "checkpoint %s %s; falling back to the previous generation at step %d", path, problem, state.step
        )
        return meta, state

    def steps(self) -> dict[str, dict[int, int]]:
        """Adapter -> block -> step of what load() returns, without touching the directory (another process may be
        writing to it)."""
        loaded = self.load(discard_interrupted=False)
        return {adapter: {b: s.step for b, s in states.items()} for adapter, (_, states) in loaded.items()}


class CheckpointWriter:
    """Writes block states on a daemon thread, so training never waits for the disk."""

    def __init__(self, store: CheckpointStore, every: int = 1):
        self.store = store
        self.every = every
        self.written: dict[tuple[str, int], int] = {}  # last step written per (adapter, block)
        self._accepted: dict[tuple[str, int], int] = {}  # last step queued or written: what `every` counts from
        self._pending: dict[tuple[str, int], tuple[dict, BlockState]] = {}
        self._submitted = self._done = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, adapter: str, meta: dict, states: dict[int, BlockState]) -> None:
        """Queue the states due (``every`` steps past the last one queued); a newer pending state replaces an older.

        The states are written later, so the caller must not modify their tensors in place.
        """
        with self._cond:
            if self._closed:
                logger.warning("checkpoint writer is closed: adapter %r blocks %s not saved", adapter, sorted(states))
                return
            queued = False
            for block, state in states.items():
                last = self._accepted.get((adapter, block))
                # a step below the last one means the adapter was reset or replaced: its new state is due now
                if last is None or state.step < last or state.step - last >= self.every:
                    self._accepted[(adapter, block)] = state.step
                    self._pending[(adapter, block)] = (meta, state)
                    queued = True
            if queued:
                self._submitted += 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far was written (failures are logged); False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Write what is pending, then stop the thread; False if it did not finish in time."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                batch, self._pending, seq = self._pending, {}, self._submitted
            done: dict[str, list[tuple[int, int, Path]]] = {}
            for (adapter, block), (meta, state) in batch.items():
                try:
                    path = self.store.save_block(adapter, block, state, meta)
                except Exception:  # the boundary of the writer thread: log, and let the next submit retry
                    logger.exception("checkpoint of adapter %r block %d at step %d failed", adapter, block, state.step)
                    with self._cond:  # let the next submit of this block retry
                        if self._accepted.get((adapter, block)) == state.step:
                            if (adapter, block) in self.written:
                                self._accepted[(adapter, block)] = self.written[(adapter, block)]
                            else:
                                del self._accepted[(adapter, block)]
                    continue
                with self._cond:
                    self.written[(adapter, block)] = state.step
                done.setdefault(adapter, []).append((block, state.step, path.parent))
            for adapter, items in done.items():
                steps = sorted({step for _, step, _ in items})
                logger.info(
                    "checkpoint of adapter %r blocks %s at step %s written to %s",
                    adapter,
                    [block for block, _, _ in items],
                    steps[0] if len(steps) == 1 else steps,
                    items[0][2],
                )
            with self._cond:
                self._done = seq
                self._cond.notify_all()
