"""Where the spot checks' tolerances come from (swarm/net/numerics.py): for blocks of a real model (SmolLM2-135M from
the GGUF on PyPI) or a tiny random one, the error each numerics class measures at load against exact fp32
(peers/calibration.py: what a peer announces), the time that measurement takes, and the difference between two
kernel sets of one class (the native CPU kernels against ``ATEN_CPU_CAPABILITY=default``, run in a subprocess):
what one class's rounding is.

Usage::

    python scripts/bench_numerics.py [--model smollm2|tiny] [--blocks 0 15 29] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from peers.calibration import block_error, relative_difference  # noqa: E402
from peers.layers import run_layers  # noqa: E402
from swarm.blocks import DTYPES, load_block  # noqa: E402
from swarm.spec import load_spec  # noqa: E402

CLASSES = [("int8", "float32"), ("nf4", "float32"), ("none", "bfloat16"), ("nf4", "bfloat16")]
KERNEL_CLASSES = [("none", "float32"), ("int8", "float32"), ("nf4", "float32")]


def model_folder(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from swarm.testing.tiny import make_tiny_model

        return make_tiny_model(workdir / "tiny-llama", family="llama", layers=4, seed=0)
    from swarm.gguf import smollm2_folder

    return smollm2_folder(workdir / "smollm2")


def outputs(folder: Path, blocks: list[int]) -> dict[str, list[float]]:
    """Each class's output and input gradient of each block on one seeded probe, flattened (for the kernel run)."""
    spec = load_spec(folder)
    rotary = spec.family_class("RotaryEmbedding")(config=spec.config)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 48, spec.config.hidden_size, generator=generator)
    hidden[..., :4] *= 20.0
    grad = torch.randn(hidden.shape, generator=generator)
    found = {}
    for quant, dtype in KERNEL_CLASSES:
        for block in blocks:
            layer = load_block(spec, block, torch.device("cpu"), DTYPES[dtype], quant)
            inputs = hidden.clone().requires_grad_(True)
            out = run_layers(spec, {block: layer}, rotary, inputs, None, range(block, block + 1))
            out.backward(grad)
            found[f"{quant}/{dtype}/{block}"] = [out.detach().tolist(), inputs.grad.tolist()]
    return found


def kernel_differences(folder: Path, blocks: list[int], workdir: Path) -> dict[str, float]:
    """The largest relative difference, output or input gradient, between this process's CPU kernels and the
    portable ones, per class and block."""
    mine = outputs(folder, blocks)
    path = workdir / "default-kernels.json"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from scripts.bench_numerics import outputs; "
        "json.dump(outputs(Path(sys.argv[2]), [int(b) for b in sys.argv[4:]]), open(sys.argv[3], 'w'))"
    )
    args = [sys.executable, "-c", code, str(ROOT), str(folder), str(path), *map(str, blocks)]
    subprocess.run(args, env=env, check=True, timeout=600)
    theirs = json.loads(path.read_text())
    return {
        key: max(
            relative_difference(torch.tensor(a), torch.tensor(b)) for a, b in zip(mine[key], theirs[key], strict=True)
        )
        for key in mine
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="default: first, middle, last")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-numerics-"))
    folder = model_folder(args.model, workdir)
    spec = load_spec(folder)
    last = spec.num_blocks - 1
    blocks = args.blocks or sorted({0, last // 2, last})
    print(f"{spec.name}: error against exact fp32 per block (what a peer announces), and seconds per block")
    print(f"{'class':<16}" + "".join(f"{'block ' + str(b):>12}" for b in blocks) + f"{'s/block':>10}")
    for quant, dtype in CLASSES:
        started, errors = time.perf_counter(), []
        for block in blocks:
            layer = load_block(spec, block, torch.device("cpu"), DTYPES[dtype], quant)
            errors.append(block_error(spec, block, layer, torch.device("cpu"), DTYPES[dtype]))
        seconds = (time.perf_counter() - started) / len(blocks)
        print(f"{quant + '/' + dtype:<16}" + "".join(f"{e:>12.3g}" for e in errors) + f"{seconds:>10.2f}")
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"\none class on two kernel sets ({capability} vs default): largest relative difference per block")
    differences = kernel_differences(folder, blocks, workdir)
    for quant, dtype in KERNEL_CLASSES:
        row = [differences[f"{quant}/{dtype}/{block}"] for block in blocks]
        print(f"{quant + '/' + dtype:<16}" + "".join(f"{d:>12.2e}" for d in row))


if __name__ == "__main__":
    main()
