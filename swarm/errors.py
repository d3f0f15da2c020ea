"""Errors a user of swarm can meet, under one base class so that ``except swarm.SwarmError`` catches them all."""

from __future__ import annotations


class SwarmError(RuntimeError):
    """Something the swarm could not do; the message says what to do next."""


class AdapterStateLostError(SwarmError):
    """No live peer holds some blocks of an adapter at its committed step (and ``resume="latest"`` was not given)."""
