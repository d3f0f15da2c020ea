"""A small emulated internet in Linux network namespaces, for the reachability tests and benchmarks.

Public hosts sit on one switch (a bridge in a namespace of its own) with addresses 10.231.0.x. A home host sits
behind its own router namespace that does NAT (nftables masquerade) and drops every connection that starts on the
internet side, like a home router without port forwards: it can dial out, nobody can dial in. Links can be capped
with ``tc ... tbf``, each way, and a home host's connections can take a detour through a relay on its router (to
add a delay: netem does not exist on every kernel). Everything is made by this object and removed by ``close()``:
no traffic leaves the namespaces, and nothing here touches the machine's own interfaces. Needs root, ``ip`` and
``nft``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PUBLIC_NET = "10.231.0"
HOME_ROUTER_RULES = """
table ip nat {
  chain postrouting {
    type nat hook postrouting priority 100;
    oifname "eth0" masquerade
  }
}
table ip filter {
  chain forward_home {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "eth1" accept
  }
}
"""
DETOUR_RULES = """
table ip detour {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "eth1" meta l4proto tcp redirect to :{port}
  }}
}}
"""


class NetLabError(RuntimeError):
    """A namespace, link or rule could not be made."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install {package}"
    probe = f"swlprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _remove_stale() -> None:
    """Namespaces left by a lab whose process was killed before it could close (named swlPID-...)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        match = re.fullmatch(r"swl(\d+)-.+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    """A machine of the lab: its namespace and the address others see it at (for a home host: its LAN address,
    which nobody outside can reach)."""

    name: str
    netns: str
    ip: str
    behind_nat: bool = False
    switch_port: str = ""  # a public host's end of its link on the switch (where what it receives is sent from)

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace (the process keeps its PID: ``ip netns exec`` execs)."""
        return ["ip", "netns", "exec", self.netns, *args]


@dataclass
class NetLab:
    """Owns namespaces and links; use as a context manager so they go away also on failure."""

    prefix: str = field(default_factory=lambda: f"swl{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    _next_ip: int = 2
    _links: int = 0
    _capped: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        _remove_stale()
        try:
            self.switch = self._namespace("net")
            self._run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            self._run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise

    # --- building --------------------------------------------------------------------------------------------

    def public(self, name: str) -> Host:
        """A host with a public address: anyone in the lab can dial it."""
        netns = self._namespace(name)
        ip, port = self._plug(netns, "eth0")
        host = Host(name, netns, ip, switch_port=port)
        self.hosts[name] = host
        return host

    def home(self, name: str) -> Host:
        """A host behind its own NAT router (``NAME-router``): it dials out, nobody dials in."""
        router = self.public(f"{name}-router")
        netns = self._namespace(name)
        lan = f"192.168.{len(self.namespaces)}"
        outside, inside = self._veth_pair()
        self._run(["ip", "link", "set", outside, "netns", router.netns])
        self._run(["ip", "link", "set", inside, "netns", netns])
        self._run(["ip", "-n", router.netns, "link", "set", outside, "name", "eth1"])
        self._run(["ip", "-n", router.netns, "addr", "add", f"{lan}.1/24", "dev", "eth1"])
        self._run(["ip", "-n", router.netns, "link", "set", "eth1", "up"])
        self._run(["ip", "-n", netns, "link", "set", inside, "name", "eth0"])
        self._run(["ip", "-n", netns, "addr", "add", f"{lan}.2/24", "dev", "eth0"])
        self._run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        self._run(["ip", "-n", netns, "route", "add", "default", "via", f"{lan}.1"])
        self._run(["ip", "netns", "exec", router.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self._run(["ip", "netns", "exec", router.netns, "nft", "-f", "-"], stdin=HOME_ROUTER_RULES)
        host = Host(name, netns, f"{lan}.2", behind_nat=True)
        self.hosts[name] = host
        return host

    def cap(self, host: Host, mbit: float, burst_kb: int = 64) -> None:
        """Limit what ``host`` sends to ``mbit`` Mbit/s (tbf on its uplink; for a home host, on its router's)."""
        self._tbf(*self._uplink(host), mbit, burst_kb)

    def cap_down(self, host: Host, mbit: float, burst_kb: int = 64) -> None:
        """Limit what ``host`` receives to ``mbit`` Mbit/s (tbf where its link is fed: its port on the switch; for a
        home host, its router's side of the home network)."""
        self._tbf(*self._downlink(host), mbit, burst_kb)

    def uncap(self, host: Host) -> None:
        """Take both caps of ``host`` off (a link never capped is left as it is)."""
        for netns, dev in (self._uplink(host), self._downlink(host)):
            if (netns, dev) in self._capped:
                self._run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"])
                self._capped.discard((netns, dev))

    def detour(self, host: Host, port: int) -> None:
        """Send every TCP connection that the home host ``host`` opens to ``port`` on its router instead, where a
        transparent relay (``python -m swarm.testing.wanlink --transparent PORT``) carries it on, with a delay: netem
        does not exist on every kernel. The relay dials out from the router, so the far end sees the router's
        address, as it would with NAT."""
        if not host.behind_nat:
            raise NetLabError(f"{host.name} is not behind a router: a detour needs one")
        rules = DETOUR_RULES.format(port=port)
        self._run(["ip", "netns", "exec", self.hosts[f"{host.name}-router"].netns, "nft", "-f", "-"], stdin=rules)

    def direct(self, host: Host) -> None:
        """Undo ``detour``: the home host's new connections go out through NAT again."""
        router = self.hosts[f"{host.name}-router"].netns
        self._run(["ip", "netns", "exec", router, "nft", "delete", "table", "ip", "detour"])

    def _uplink(self, host: Host) -> tuple[str, str]:
        """Where what ``host`` sends leaves for the switch: (namespace, device)."""
        return (self.hosts[f"{host.name}-router"].netns if host.behind_nat else host.netns), "eth0"

    def _downlink(self, host: Host) -> tuple[str, str]:
        """Where what ``host`` receives is sent from: (namespace, device)."""
        if host.behind_nat:
            return self.hosts[f"{host.name}-router"].netns, "eth1"
        return self.switch, host.switch_port

    def _tbf(self, netns: str, dev: str, mbit: float, burst_kb: int) -> None:
        self._run(
            ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf"]
            + ["rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"]
        )
        self._capped.add((netns, dev))

    def _namespace(self, name: str) -> str:
        netns = f"{self.prefix}-{name}"
        self._run(["ip", "netns", "add", netns])
        self.namespaces.append(netns)
        self._run(["ip", "-n", netns, "link", "set", "lo", "up"])
        return netns

    def _plug(self, netns: str, ifname: str) -> tuple[str, str]:
        """Connect ``netns`` to the switch; returns its public address and its port on the switch."""
        ip = f"{PUBLIC_NET}.{self._next_ip}"
        self._next_ip += 1
        outside, inside = self._veth_pair()
        self._run(["ip", "link", "set", inside, "netns", netns])
        self._run(["ip", "link", "set", outside, "netns", self.switch])
        self._run(["ip", "-n", self.switch, "link", "set", outside, "master", "br0"])
        self._run(["ip", "-n", self.switch, "link", "set", outside, "up"])
        self._run(["ip", "-n", netns, "link", "set", inside, "name", ifname])
        self._run(["ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", ifname])
        self._run(["ip", "-n", netns, "link", "set", ifname, "up"])
        return ip, outside

    def _veth_pair(self) -> tuple[str, str]:
        """A new veth pair, created in this (root) namespace and moved away at once; names are short and ours."""
        self._links += 1
        a, b = f"{self.prefix}v{self._links}a", f"{self.prefix}v{self._links}b"
        self._run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        return a, b

    def _run(self, args: list[str], stdin: str | None = None) -> None:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True)
        if done.returncode != 0:
            raise NetLabError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")

    # --- tearing down ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace made (their veth ends and rules go with them)."""
        for netns in reversed(self.namespaces):
            done = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True)
            if done.returncode != 0:
                logger.warning("could not delete namespace %s: %s", netns, done.stderr.strip())
        self.namespaces.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
