"""The cost of the exact update (peers/update.py) against torch's AdamW, per block at Llama-3-70B's LoRA sizes: r=16
on all seven projections of a block (hidden 8192, 8 KV heads of 128, intermediate 28672) is 2.59 M parameters in 14
tensors. Both update the same tensors from the same gradients; printed: milliseconds per block update (the median of
``--repeats``), the ratio, and the largest difference between their results after those updates.

Usage::

    python scripts/bench_update.py [--device cpu|cuda] [--repeats 20] [--rank 16] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peers.update import BlockOptimizer  # noqa: E402
from swarm.net.protocol import OptimizerHParams  # noqa: E402

HIDDEN, KV, INTERMEDIATE = 8192, 8 * 128, 28672
PROJECTIONS = {  # (in, out) of each projection a LoRA r wraps in a Llama-3-70B block
    "q": (HIDDEN, HIDDEN),
    "k": (HIDDEN, KV),
    "v": (HIDDEN, KV),
    "o": (HIDDEN, HIDDEN),
    "gate": (HIDDEN, INTERMEDIATE),
    "up": (HIDDEN, INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}


def lora_tensors(rank: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [shape for fan_in, fan_out in PROJECTIONS.values() for shape in ((rank, fan_in), (fan_out, rank))]
    return [(torch.rand(shape, generator=g) - 0.5).to(device, dtype) for shape in shapes]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(step, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    hp = OptimizerHParams(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    exact_params = lora_tensors(args.rank, args.device, dtype)
    grads = [(p.float() * 0.01 + 0.001).to(dtype) for p in exact_params]
    torch_params = [torch.nn.Parameter(p.clone()) for p in exact_params]
    for param, grad in zip(torch_params, grads, strict=True):
        param.grad = grad
    n = sum(p.numel() for p in exact_params)
    exact = BlockOptimizer()
    adamw = torch.optim.AdamW(torch_params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    exact_ms = timed(lambda: exact.step(exact_params, grads, hp), args.device, args.repeats)
    torch_ms = timed(adamw.step, args.device, args.repeats)
    differ = max(float((a - b.detach()).abs().max()) for a, b in zip(exact_params, torch_params, strict=True))
    threads = torch.get_num_threads()
    print(
        f"{args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else f'{threads} threads'}), "
        f"torch {torch.__version__}, {args.dtype}, LoRA r={args.rank} on 7 projections: {n / 1e6:.2f} M parameters "
        "per block"
    )
    print(f"{'update':<28} {'ms / block':>10}")
    print(f"{'torch.optim.AdamW (default)':<28} {torch_ms:>10.1f}")
    print(f"{'exact (peers/update.py)':<28} {exact_ms:>10.1f}")
    print(f"exact / torch: {exact_ms / torch_ms:.2f}x; largest difference after {args.repeats} updates: {differ:.2e}")


if __name__ == "__main__":
    main()
