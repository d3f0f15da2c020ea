"""Third-party warnings a user cannot act on, kept off every start of a peer, a client and the CLI.

bitsandbytes, on a CPU with AVX512-BF16, tries at import to load an optional fused NF4 kernel from the Hugging Face
hub through the ``kernels`` package (which transformers installs); ``kernels`` refuses the unverified repository, and
bitsandbytes falls back to its own CPU kernel, the one swarm is tested with. Its warning ("Failed to load CPU
gemm_4bit_forward from kernels-community ... Set trust_remote_code=True") would be printed by every process. This
silences that message only, and only where swarm is imported before bitsandbytes (peft imports it at once).
"""

from __future__ import annotations

import logging

HUB_KERNEL_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropHubKernelWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HUB_KERNEL_WARNING)


def silence_third_party() -> None:
    """Install the filters (idempotent)."""
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropHubKernelWarning) for f in bnb.filters):
        bnb.addFilter(_DropHubKernelWarning())
