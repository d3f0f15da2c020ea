"""A model is its weights, not its folder's name: a look-alike (same folder name, same config, other random weights)
serving blocks beside the honest peers is never routed to, copied from or asked to hold state, even when the honest
server of its blocks dies mid-training; it shows as mismatched; two models sharing a folder name train side by side
in one swarm without mixing. Under two busy processes (``cpu_load``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.net.errors import WeightsMismatchError
from swarm.net.protocol import Method
from swarm.ops.health import MISMATCHED, build
from swarm.ops.status import Observer
from swarm.spec import load_spec
from swarm.testing.faults import Action, Fault
from swarm.testing.inprocess import InProcessSwarm
from swarm.testing.recipe import assert_matches_local_peft, connect
from swarm.testing.recipe import train as train_steps
from swarm.testing.tiny import make_tiny_model
from swarm.weights import block_digests

NEVER_ASKED = (Method.OPEN, Method.FORWARD, Method.BACKWARD, Method.COMMIT, Method.EXPORT, Method.REPLICATE)


def look_alike(root: Path, honest: Path) -> Path:
    """The honest folder's name and config, other random weights, in another parent folder."""
    return make_tiny_model(root / "elsewhere" / honest.name, family="llama", layers=4, seed=2)


def train(swarm: InProcessSwarm, model_dir: Path, out: Path, adapter: str) -> None:
    model = connect(swarm, model_dir, adapter)
    try:
        model.save_adapter(out / "initial")
        train_steps(model)
        model.save_adapter(out / "final")
    finally:
        model.shutdown()


def test_a_look_alike_is_never_used_when_the_honest_server_dies(inprocess_swarm, tiny_models, tmp_path, cpu_load):
    """Peers b and c serve the honest 2:4, the look-alike serves 2:4 too; b dies in its second commit. Training goes
    on through c; the look-alike is never opened, called, copied from or asked to hold a copy, the swarm's status
    shows it mismatched, it refuses the adapter with a typed error, and the adapter equals local peft."""
    honest = tiny_models["llama"]
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4", "c": "2:4"})
    evil = swarm.add_peer("2:4", "evil", model=str(look_alike(tmp_path, honest)))
    killed = peers["b"].faults.arm(Fault(Action.KILL, Method.COMMIT, nth=2))
    train(swarm, honest, tmp_path, "pinned")
    assert killed.wait_fired(0) and peers["b"].killed
    assert {method: evil.faults.calls[method] for method in NEVER_ASKED} == dict.fromkeys(NEVER_ASKED, 0)
    assert "pinned" not in evil.adapters.by_name
    observer = Observer(swarm.initial_peers, None)
    try:
        seen = observer.observe(load_spec(honest).name, 4)
    finally:
        observer.close()
    health = build(seen.model, 4, seen.view, 2, seen.committed)
    states = {p.peer: p.state for p in health.peers if p.state != "unreachable"}  # b's record may linger
    assert states[evil.peer_id.to_base58()] == MISMATCHED
    assert states[peers["c"].peer_id.to_base58()] == "online"
    with pytest.raises(WeightsMismatchError, match="blocks 2:4"):
        evil.adapters.open_adapter("pinned", seen.committed["pinned"].lora, 11, None, block_digests(load_spec(honest)))
    assert evil.adapters.mismatched == {"pinned": [2, 3]}
    assert_matches_local_peft(honest, tmp_path)


def test_two_models_sharing_a_folder_name_train_side_by_side_without_mixing(
    inprocess_swarm, tiny_models, tmp_path, cpu_load
):
    """Two folders named alike with other weights, each served by its own peers in one swarm: each client trains its
    adapter on its own model's peers only (equal to local peft on its folder), and a client of the other folder
    cannot resume an adapter pinned to the first one's weights."""
    ours, theirs = tiny_models["llama"], look_alike(tmp_path, tiny_models["llama"])
    swarm = inprocess_swarm()
    mine = swarm.start_peers({"a0": "0:2", "a1": "2:4"})
    others = swarm.start_peers({"b0": "0:2", "b1": "2:4"}, model=str(theirs))
    train(swarm, ours, tmp_path / "ours", "ours")
    train(swarm, theirs, tmp_path / "theirs", "theirs")
    for peer in mine.values():
        assert set(peer.adapters.by_name) == {"ours"}
    for peer in others.values():
        assert set(peer.adapters.by_name) == {"theirs"}
    assert_matches_local_peft(ours, tmp_path / "ours")
    assert_matches_local_peft(theirs, tmp_path / "theirs")
    with pytest.raises(WeightsMismatchError, match="trained on other base weights"):
        connect(swarm, theirs, "ours", patience=10.0)
