"""A third-party warning nobody can act on is dropped; everything else from the same logger still shows."""

from __future__ import annotations

import logging

import swarm  # noqa: F401  (installs the filters)
from swarm.quiet import HUB_KERNEL_WARNING


def test_bitsandbytes_hub_kernel_warning_is_dropped_and_its_other_warnings_are_not(caplog):
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(HUB_KERNEL_WARNING + ": %s. Please make sure you already `pip install kernels`", "untrusted")
        logger.warning("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
