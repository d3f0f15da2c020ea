"""What becomes adapter state is the same bits on every machine, so replicas on other hardware vote alike: the update
every holder applies (peers/update.py: torch's AdamW within fp32 rounding, bit for bit a chain of unfused IEEE
operations) and the LoRA init (swarm/blocks.py: peft's kaiming A from a CPU generator, scaled without fusion; DoRA's
magnitude from the stored weights)."""

from __future__ import annotations

import math

import numpy as np
import peft
import torch

from peers.update import BlockOptimizer, adamw_, correctly_rounded_sqrt, new_moments, one_minus_power
from swarm.blocks import add_lora, kaiming_uniform, load_block
from swarm.dropout import keep_mask
from swarm.net.protocol import OptimizerHParams
from swarm.spec import load_spec
from swarm.testing.tiny import make_tiny_model

HP = OptimizerHParams(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
STEPS = 20


def _data(n: int = 10_007) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, generator=g) - 0.5, [torch.rand(n, generator=g) - 0.5 for _ in range(STEPS)]


def test_the_update_is_torchs_adamw_within_fp32_rounding():
    """The bound: after 20 steps no weight is further from torch's AdamW than 2e-7 plus 1e-6 of itself (a few fp32
    ulps per step, the steps' own rounding: lerp, addcmul and addcdiv round once where this rounds twice)."""
    start, grads = _data()
    exact, moments = start.clone(), new_moments(start)
    reference = torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=HP.lr, betas=HP.betas, eps=HP.eps, weight_decay=HP.weight_decay)
    for grad in grads:
        adamw_(exact, grad, moments, HP)
        reference.grad = grad.clone()
        torch_adamw.step()
    assert not torch.equal(exact, start)
    torch.testing.assert_close(exact, reference.detach(), rtol=1e-6, atol=2e-7)
    state = torch_adamw.state[reference]
    assert moments.keys() == state.keys() and moments["step"].item() == state["step"].item() == STEPS
    torch.testing.assert_close(moments["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-6, atol=1e-12)


def _numpy_adamw(param: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """The same update as a sequence of single IEEE fp32 operations in numpy, each correctly rounded by definition:
    what every device computes when no operation is fused."""
    f32 = np.float32
    beta1, beta2 = HP.betas
    m, v = np.zeros_like(param), np.zeros_like(param)
    for step, grad in enumerate(grads, start=1):
        param = param * f32(1.0 - HP.lr * HP.weight_decay)
        m = m * f32(beta1) + grad * f32(1.0 - beta1)
        v = v * f32(beta2) + (grad * grad) * f32(1.0 - beta2)
        denom = np.sqrt(v) * f32(1.0 / math.sqrt(one_minus_power(beta2, step))) + f32(HP.eps)
        param = param - (m / denom) * f32(HP.lr / one_minus_power(beta1, step))
    return param


def test_the_same_bits_as_unfused_ieee_operations():
    """Bit for bit what a chain of correctly rounded fp32 operations gives (numpy's, here): a fused multiply-add,
    lerp, addcmul or addcdiv anywhere would round otherwise on some device, and replicas on other hardware (another
    GPU, ``ATEN_CPU_CAPABILITY=default``) would stop agreeing. torch's AdamW does not pass this."""
    start, grads = _data()
    exact, moments = start.clone(), new_moments(start)
    for grad in grads:
        adamw_(exact, grad, moments, HP)
    expected = _numpy_adamw(start.numpy(), [g.numpy() for g in grads])
    assert np.array_equal(exact.numpy(), expected)
    reference = torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=HP.lr, betas=HP.betas, eps=HP.eps, weight_decay=HP.weight_decay)
    for grad in grads:
        reference.grad = grad.clone()
        torch_adamw.step()
    assert not np.array_equal(reference.detach().numpy(), expected), "the test tells fused rounding from unfused"


def test_bias_corrections_need_no_pow_and_a_block_keeps_torchs_state_keys():
    for beta in (0.9, 0.999, 0.95):
        for step in (1, 2, 7, 1000, 54321):
            assert abs(one_minus_power(beta, step) - (1 - beta**step)) <= 1e-12
    params = [torch.zeros(3), torch.zeros(2, 2)]
    optimizer = BlockOptimizer()
    optimizer.step(params, [torch.ones(3), torch.ones(2, 2)], HP)
    assert [sorted(optimizer.state[p]) for p in params] == [["exp_avg", "exp_avg_sq", "step"]] * 2
    assert torch.allclose(params[0], torch.full((3,), -HP.lr))  # the first step moves each weight by -lr


def test_the_square_root_is_correctly_rounded():
    values = torch.rand(200_003, generator=torch.Generator().manual_seed(1)) * 1e-3
    exact = np.sqrt(values.numpy().astype(np.float64)).astype(np.float32)  # float64 root of a float32: rounds right
    assert np.array_equal(correctly_rounded_sqrt(values).numpy(), exact)


def test_lora_a_starts_as_peft_draws_it_in_the_same_bits_everywhere():
    """Uniform in +-1/sqrt(fan_in) like ``kaiming_uniform_(a=sqrt(5))`` (whose fused scaling rounds otherwise under
    ``ATEN_CPU_CAPABILITY=default``): the CPU generator's draws, times 2b, minus b, each rounded once."""
    shape = torch.Size([8, 640])
    init = kaiming_uniform(shape, torch.Generator().manual_seed(5))
    draws = torch.rand(shape, generator=torch.Generator().manual_seed(5)).numpy()
    bound = 1.0 / math.sqrt(640)
    assert np.array_equal(init.numpy(), draws * np.float32(2.0 * bound) - np.float32(bound))
    assert init.abs().max() <= bound and init.min() < -0.9 * bound and init.max() > 0.9 * bound
    peft_like = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(peft_like, a=math.sqrt(5), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(init, peft_like, rtol=0, atol=1e-7)  # the same draws, rounded alike but for fusion


def test_dropout_masks_are_a_hash_of_their_key_and_index_computed_exactly():
    """The mask a device computes is the integer hash written out in Python's own integers (what any device's exact
    int64 arithmetic gives), keeps about ``keep`` of the elements, and changes with the key."""
    shape, keep, key = torch.Size([4, 7, 33]), 0.9, 0x1234_5678_9ABC_DEF0
    mask = keep_mask(shape, keep, key, torch.device("cpu"))

    def mix(x: int) -> int:
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    expected = [(mix(mix(i ^ (key & 0xFFFFFFFF)) ^ (key >> 32)) >> 8) < round(keep * 2**24) for i in range(924)]
    assert mask.reshape(-1).tolist() == expected
    big = keep_mask(torch.Size([200_000]), keep, key, torch.device("cpu"))
    assert abs(big.float().mean().item() - keep) < 0.005
    other = keep_mask(torch.Size([200_000]), keep, key + 1, torch.device("cpu"))
    assert abs((big == other).float().mean().item() - (keep**2 + (1 - keep) ** 2)) < 0.005  # independent masks


def test_doras_magnitude_is_the_stored_weights_row_norm_whatever_the_peers_quantization(tmp_path):
    """From the weights as stored, not as a peer quantized them, summed in float64: an fp32, an int8 and an NF4
    replica start from the same bits, within an ulp of peft's own norm of the fp32 weight."""
    spec = load_spec(make_tiny_model(tmp_path / "tiny", family="llama", layers=2, seed=0))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True)
    magnitudes = {}
    for quant in ("none", "int8", "nf4"):
        layer = load_block(spec, 1, torch.device("cpu"), torch.float32, quant)
        params = add_lora(layer, spec, 1, "dora", config, seed=3)
        magnitudes[quant] = {lp.name: lp.param.detach() for lp in params if "magnitude" in lp.name}
    assert sorted(magnitudes["none"]) == [
        "mlp.down_proj.lora_magnitude_vector.weight",
        "self_attn.q_proj.lora_magnitude_vector.weight",
    ]
    for quant in ("int8", "nf4"):
        assert all(torch.equal(magnitudes[quant][k], v) for k, v in magnitudes["none"].items()), quant
    exact = load_block(spec, 1, torch.device("cpu"), torch.float32, "none")
    norm = torch.linalg.norm(exact.self_attn.q_proj.weight, dim=1)
    magnitude = magnitudes["none"]["self_attn.q_proj.lora_magnitude_vector.weight"]
    torch.testing.assert_close(magnitude, norm, rtol=2e-7, atol=0)
