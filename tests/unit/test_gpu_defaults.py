"""Issue 57 item 3: a peer computes in bfloat16 on a CUDA device that supports it and in float32 elsewhere, unless
told; the dtype a PeerConfig names is what the whole peer uses (its numerics, its weights' bytes)."""

from __future__ import annotations

import torch

from peers.config import PeerConfig, default_dtype


def test_a_cpu_peer_computes_in_float32_unless_told():
    assert PeerConfig(model="m", initial_peers=[]).dtype == "float32"
    assert PeerConfig(model="m", initial_peers=[], dtype="bfloat16").dtype == "bfloat16"
    assert default_dtype("cpu") == "float32"


def test_a_cuda_peer_computes_in_bfloat16_where_the_device_does(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert default_dtype("cuda") == "bfloat16" and default_dtype("cuda:1") == "bfloat16"
    config = PeerConfig(model="m", initial_peers=[], device="cuda")
    assert (config.dtype, config.quant_mode) == ("bfloat16", "nf4")
    assert PeerConfig(model="m", initial_peers=[], device="cuda", dtype="float32").dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)  # a pre-Ampere card
    assert default_dtype("cuda") == "float32"
