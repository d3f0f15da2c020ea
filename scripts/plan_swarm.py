"""The seed's case on paper, from the code's own numbers (issue 47, item 5): Llama-3-70B in NF4 on 6 x 24 GB GPUs
at home, LoRA r=16 on all seven projections, 16 micro-batches of 1 x 2048 tokens a step.

    .venv/bin/python scripts/plan_swarm.py                                   # the seed case: 100/100 and 100/20, 30 ms
    .venv/bin/python scripts/plan_swarm.py --config swarm/configs/llama-3-8b.json --tie-draws 0 --links 100/100

It places spans as the balancer would (peers/balancer.py ``choose_span``, then ``next_move`` rounds), counts the bytes
each link carries per step with the functions that size the real messages, plays the step out with the simulation's
step model (swarm/testing/steps.py) plus transfers, and prints the step and its parts against the same GPUs in one box,
before (per-micro-batch gradient exchange) and after (one reduction per step). See swarm/planning.py for the model.
A peer's memory, part by part, and the span it takes by default come from swarm/memory.py (issue 57).

The GPUs' speed is not measured (no GPU was lent): peak dense bf16 tensor TFLOPS from NVIDIA's whitepapers
(``swarm.planning.GPUS``) times an assumed utilisation (``--utilisation``, default 0.4), turned into seconds of a
block's forward by 2 x params x tokens FLOPs (plus causal attention).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers.balancer import Snapshot, choose_span, choose_standby, next_move  # noqa: E402
from swarm.memory import (  # noqa: E402
    ACTIVATION_CACHE_MB,
    CUDA_CONTEXT_GIB,
    DEFAULT_IN_FLIGHT,
    DEFAULT_MICRO_BATCHES,
    DEFAULT_TOKENS,
    FREE_SHARE,
    GIB,
    KEPT_INPUTS_MB,
    MAX_INFERENCE_MB,
    Breakdown,
    Lora,
    MemoryInputs,
    breakdown,
    card_free_bytes,
    default_num_blocks,
    default_tokens_in_flight,
    load_shape,
    lora_params,
    tokens_in_flight_bound,
)
from swarm.net.compression import WireFormat  # noqa: E402
from swarm.planning import (  # noqa: E402
    CLIENT,
    CONFIGS,
    GPUS,
    UTILISATION,
    Gpu,
    Link,
    Network,
    Rules,
    activation_bytes,
    block_forward_seconds,
    block_grad_bytes,
    chains_of,
    in_flight_for,
    lanes_of,
    peer_names,
    place,
    plan_step,
    servers_of,
)

RULES = Rules(choose_span, next_move, choose_standby, Snapshot)
WIRES = {
    "exact": WireFormat(),
    "bfloat16": WireFormat("bfloat16"),
    "blockwise8": WireFormat(compression="blockwise8"),
    "hadamard4": WireFormat(compression="hadamard4"),
    "hadamard3": WireFormat(compression="hadamard3"),
    "hadamard4d3": WireFormat(compression="hadamard4d3"),  # a sample's later passes: 3-bit changes, 4-bit gradients
}
MB = 1e6
PARTS = {  # what each part of a peer's memory is (swarm/memory.py ``Breakdown``)
    "weights": "base weights",
    "adapters": "LoRA + AdamW moments (fp32)",
    "grads": "micro-batch LoRA gradients: this step's, and the last step's kept for an undo",
    "block_inputs": "block inputs of the micro-batches in flight (the activation cache, bounded)",
    "graph": "one block's graph of one micro-batch (per-block recompute)",
    "workspace": "the backward's temporaries and one dequantized weight",
    "inference": "generation sessions (--max-inference-mb, only while generating)",
    "span_inputs": "span inputs kept until the step commits",
    "standby": "standby copies (state and the state before)",
    "applied": "state before the last apply, its update, fetched partial sums",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "llama-3-70b.json"), help="a config.json (shapes only)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--gpus", type=int, default=6, help="peers, one GPU each")
    p.add_argument("--gpu", choices=sorted(GPUS), default="rtx3090")
    p.add_argument("--gpu-gib", type=float, help="memory per GPU (default: the table's)")
    p.add_argument("--tflops", type=float, help="peak dense bf16 TFLOPS (default: the table's)")
    p.add_argument("--utilisation", type=float, default=UTILISATION, help="assumed share of the peak reached")
    p.add_argument("--quant", choices=["nf4", "int8", "none"], default="nf4")
    p.add_argument("--replication", type=int, default=2, help="the peers' --replication R")
    p.add_argument("--num-blocks", type=int, help="span length (default: ceil(R x blocks / GPUs), if it fits)")
    p.add_argument("--activation-cache-mb", type=int, default=ACTIVATION_CACHE_MB, help="the peers' bound")
    p.add_argument("--max-inference-mb", type=int, default=MAX_INFERENCE_MB, help="the peers' bound")
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--in-flight", type=int, help="default: the client's, two per server (4 to 32)")
    p.add_argument("--wire", choices=sorted(WIRES), default="exact", help="activations on the wire")
    p.add_argument("--links", nargs="+", default=["100/100", "100/20"], help="DOWN/UP Mbit/s of every home")
    p.add_argument("--client-link", help="DOWN/UP of the client's home (default: the peers')")
    p.add_argument("--rtt-ms", type=float, default=30.0, help="round trip between any two homes")
    p.add_argument("--min-copies", type=int, default=2)
    p.add_argument("--clip", action="store_true", help="global gradient clipping (a norms fetch before the commit)")
    p.add_argument("--modes", nargs="+", choices=["before", "after"], default=["before", "after"])
    p.add_argument("--seed", type=int, help="draw the balancer's start-up ties at random (default: leftmost)")
    p.add_argument("--tie-draws", type=int, default=200, help="random start orders to count clean placements in")
    return p.parse_args(argv)


def clean_placement(spans: dict[str, range], num_blocks: int, replication: int) -> bool:
    """R disjoint pipelines over the model, every block with R servers."""
    full = all(len(s) >= replication for s in servers_of(spans, num_blocks))
    return full and len(chains_of(spans, num_blocks)) >= replication


def mb(nbytes: float) -> str:
    return f"{nbytes / MB:,.1f}"


def print_memory(memory: Breakdown, case: MemoryInputs, span_len: int, why: str, memory_gib: float) -> None:
    """A peer's memory by part (swarm/memory.py), and its margin under the card's size."""
    used = memory.device + CUDA_CONTEXT_GIB * GIB
    print(
        f"\nMemory per GPU (swarm/memory.py), span {span_len} ({why}), {case.tokens} tokens a micro-batch, "
        f"{case.in_flight} micro-batches in flight through a peer, {case.micro_batches} a step, "
        f"{case.standby} standby copies:\n"
    )
    print("| part | GiB | what |")
    print("|---|---|---|")
    for name, nbytes in memory.parts().items():
        where = " (host memory)" if name in Breakdown.HOST else ""
        print(f"| {name} | {nbytes / GIB:.2f} | {PARTS[name]}{where} |")
    print(f"| CUDA context | {CUDA_CONTEXT_GIB:.2f} | in use before a peer loads |")
    print(
        f"| **on the GPU** | **{used / GIB:.2f}** | of {memory_gib:g} GiB: margin {memory_gib - used / GIB:.2f} GiB "
        f"(the default span keeps {1 - FREE_SHARE:.0%} of the free memory spare) |"
    )
    print(f"| host memory | {memory.host / GIB:.2f} | beside the GPU's |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = load_shape(args.config)
    lora = Lora(args.rank, tuple(t.strip() for t in args.targets.split(",") if t.strip()))
    base = GPUS[args.gpu]
    gpu = Gpu(base.name, args.gpu_gib or base.memory_gib, args.tflops or base.bf16_tflops, base.source)
    tokens, L, R, M = args.batch * args.seq, shape.layers, args.replication, args.micro_batches
    wire, dtype = WIRES[args.wire], torch.bfloat16

    in_flight = args.in_flight or in_flight_for(args.gpus)
    free = card_free_bytes(gpu.memory_gib)
    case = MemoryInputs(
        shape,
        args.quant,
        dtype_bytes=2,  # bf16 compute, a CUDA peer's default
        lora=lora,
        tokens=tokens,
        in_flight=math.ceil(in_flight / R),  # the client's micro-batches in flight, over R pipelines
        micro_batches=M,
        replication=R,
        cache_bytes=args.activation_cache_mb << 20,
        inference_bytes=args.max_inference_mb << 20,
    )
    fits = default_num_blocks(case, free)
    default_load = replace(
        case, tokens=DEFAULT_TOKENS, in_flight=DEFAULT_IN_FLIGHT, micro_batches=DEFAULT_MICRO_BATCHES
    )
    default_span = default_num_blocks(default_load, free)
    even = math.ceil(R * L / args.gpus)  # R copies spread evenly: what an operator passes as --num-blocks
    span_len = args.num_blocks or min(fits, even)
    why = "told" if args.num_blocks else f"ceil({R} x {L} / {args.gpus})" if span_len == even else "what fits"
    sized = replace(case, blocks=span_len)
    peers = peer_names(args.gpus)
    spans = place(RULES, peers, L, span_len, R, seed=args.seed)
    chains = chains_of(spans, L)
    servers = servers_of(spans, L)
    block_s = block_forward_seconds(shape, lora, tokens, args.seq, gpu, args.utilisation)
    act = activation_bytes(shape, args.batch, args.seq, wire, dtype)
    grad_act = activation_bytes(shape, args.batch, args.seq, wire, dtype, backward=True)
    g_block = block_grad_bytes(shape, lora)
    grad = [float(g_block)] * L

    print(f"## {shape.name}: {args.gpus} x {gpu.name} ({gpu.memory_gib:g} GiB), {args.quant}, R={R}\n")
    print("```")
    print(f"python scripts/plan_swarm.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print("```\n")
    print(
        f"- compute (assumed, not measured): {gpu.bf16_tflops:g} peak dense bf16 TFLOPS ({gpu.source}) x "
        f"{args.utilisation:g} utilisation; a block's forward = 2 x (params + LoRA) x tokens + causal attention = "
        f"{block_s / tokens * 1e6:.1f} us/token, {block_s:.3f} s per {args.batch} x {args.seq} micro-batch; "
        "backward = 2 forwards"
    )
    print(
        f"- LoRA r={lora.rank} on {','.join(t.removesuffix('_proj') for t in lora.targets)}: "
        f"{lora_params(shape, lora):,} params a block; G (fp32 gradient) {mb(g_block)} MB a block"
    )
    print(
        f"- memory: the longest span that fits this load is {fits} blocks; the daemon's default --num-blocks "
        f"{default_span} ({DEFAULT_IN_FLIGHT} micro-batches of {DEFAULT_TOKENS} tokens in flight, "
        f"{DEFAULT_MICRO_BATCHES} a step); a peer of {span_len} blocks would keep at most "
        f"{tokens_in_flight_bound(sized, free):,} tokens in flight with every block input on the GPU, and admits "
        f"{default_tokens_in_flight(sized, free, KEPT_INPUTS_MB << 20):,} by default (--max-tokens-in-flight: block "
        "inputs past the activation cache are recomputed from span inputs in host memory)"
    )
    lanes, chunk = lanes_of(act)
    print(
        f"- activations: {mb(act)} MB a message forward, {mb(grad_act)} MB backward ({args.wire}, bf16 compute), "
        f"{lanes} lanes of {chunk // 1024} KiB; "
        f"{M} micro-batches, {in_flight} in flight, chained"
    )
    print_memory(breakdown(sized), sized, span_len, why, gpu.memory_gib)
    print("\nPlacement (peers/balancer.py `choose_span`, then `next_move` rounds):\n")
    print("| peer | span | blocks |")
    print("|---|---|---|")
    for peer in peers:
        s = spans[peer]
        print(f"| {peer} | {s.start}:{s.stop} | {len(s)} |")
    short = [b for b in range(L) if len(servers[b]) < R]
    print(
        f"\n{len(chains)} pipeline(s): "
        + "; ".join(" -> ".join(f"{p} {h.start}:{h.stop}" for p, h in c) for c in chains)
        + (f"; blocks under R={R}: {len(short)}" if short else "; every block at R")
    )
    if args.tie_draws:
        clean = sum(
            clean_placement(place(RULES, peers, L, span_len, R, seed=seed), L, R) for seed in range(args.tie_draws)
        )
        print(
            f"\nWith the start-up ties drawn at random instead (seeds 0-{args.tie_draws - 1}), {clean} of "
            f"{args.tie_draws} start orders settle into {R} disjoint pipelines with every block at R={R}."
        )
    print()
    if not chains:
        print("no pipeline covers the model: nothing to play")
        return

    rows = []
    for text in args.links:
        link = Link.parse(text)
        client = Link.parse(args.client_link) if args.client_link else link
        net = Network({CLIENT: client, **dict.fromkeys(peers, link)}, args.rtt_ms / 1000)
        for mode in args.modes:
            plan = plan_step(
                RULES,
                spans,
                chains,
                L,
                block_s,
                act,
                grad,
                net,
                M,
                in_flight,
                mode,
                args.min_copies,
                args.clip,
                grad_act=grad_act,
            )
            rows.append((link, client, plan))

    print(
        f"Step (s), RTT {args.rtt_ms:g} ms. one box: the same {args.gpus} GPUs and spans in one machine, transfers "
        "and reduction free (`step_seconds`); ratio = one box / swarm step (1.0: as fast as one box).\n"
    )
    print(
        "| links down/up | mode | pipeline | clip | commit (reduction) | copies | critical path | link bound | step "
        "| one box | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for link, client, p in rows:
        where = f"{link}" + (f", client {client}" if client != link else "")
        print(
            f"| {where} | {p.mode} | {p.pipeline:.1f} | {p.clip:.1f} | {p.commit:.1f} | {p.copies:.1f} | "
            f"{p.critical:.1f} | {p.link_bound:.1f} ({p.busiest}) | **{p.step:.1f}** | {p.one_box:.1f} | "
            f"**{p.ratio:.2f}** |"
        )
    print("\nMB per step through each home, up / down (bytes do not depend on the bandwidth):\n")
    plans = {p.mode: p for _, _, p in reversed(rows)}  # the first link setting's
    columns = [("activations", None), ("ledger", None)]
    columns += [("reduction", mode) for mode in args.modes] + [("copies", None), ("standby", None)]
    heads = [f"{kind} ({mode})" if mode else kind for kind, mode in columns]
    print("| party | " + " | ".join(heads) + " | " + " | ".join(f"total ({m})" for m in args.modes) + " |")
    print("|---|" + "---|" * (len(columns) + len(args.modes)))
    any_plan = plans[args.modes[-1]]
    for party in any_plan.up:
        cells = []
        for kind, mode in columns:
            p = plans[mode or args.modes[-1]]
            cells.append(f"{mb(p.up[party].get(kind, 0))} / {mb(p.down[party].get(kind, 0))}")
        totals = [
            f"{mb(sum(plans[m].up[party].values()))} / {mb(sum(plans[m].down[party].values()))}" for m in args.modes
        ]
        print(f"| {party} | " + " | ".join(cells + totals) + " |")


if __name__ == "__main__":
    main()
