"""Several "hosts" on one machine: Linux network namespaces on a bridge, for multi-node tests.

    with netns.hosts(2) as net:            # needs root (CAP_NET_ADMIN) and iproute2's `ip`
        p = net[1].popen(["python", "-c", "..."], env={...})
        net[0].addr, net[0].ifname          # 10.77.X.10, "ml0"

Each host is a network namespace with loopback up and one veth, named `ml0` inside every host
(so one GLOO_SOCKET_IFNAME fits all), whose other end is a port of a bridge in the root namespace.
The bridge holds the subnet's `.1` (the root namespace is reachable from every host there, e.g. for
a Slurm controller), host i holds `.10 + i`. The subnet is 10.77.X.0/24 with the first X that no
address or route of the root namespace uses. There is no default route: a host reaches its
subnet and nothing else.

Every host also gets /etc/netns/<namespace>/hosts and resolv.conf, which `ip netns exec`
bind-mounts over /etc/hosts and /etc/resolv.conf for what it starts: the machine's hosts file plus
every host's name, so host names (e.g. Slurm node names) resolve to their bridge addresses inside
the hosts; and a resolver on the host's own loopback, so no DNS query goes anywhere.

Names are `ml<tag><pid>h<i>` (namespaces), `ml<tag><pid>br` (bridge), `ml<tag><pid>v<i>` (veths,
root side); the pid is the creating process's. Leaving the context (normally, on an exception,
on KeyboardInterrupt) SIGKILLs whatever still runs in the namespaces and removes namespaces,
veths, bridge and /etc/netns files. Leftovers of a crashed run, i.e. objects of this naming whose
pid is not a live process (or is ours, from a reused pid), are removed before creating anything.

Slow links: `net.limit(LinkLimit(rate_mbit=200))` (or `hosts(..., link=...)`) puts a token-bucket
filter (`tc qdisc replace ... root tbf`) on both ends of every host's veth: inside the namespace
(what the host sends) and on the root-side end (what it receives), so each host has `rate_mbit` in
each direction. tbf limits the rate only: its `latency` is how long a packet may wait in the queue
before it is dropped (the queue's length), not a delay added to every packet; this kernel has no
`netem`, so round-trip times stay those of a veth (tens of microseconds).

Run a command with hosts around it (they are removed when it ends):

    python tests/netns.py --hosts 2 --names node0,node1 -- bash -c 'env | grep MEGALITE_NETNS'
    python tests/netns.py --hosts 2 --rate-mbit 200 -- bash -c '...'      # 200 Mbit/s links
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from netns_tools import (_ACTIVE, _CREATED_ETC, NETNS_ETC, LinkLimit, NetnsError, _ip, _remove_link,  # (beside this file)
                         _remove_netns, _tc, clean_stale, ip_command, kill_netns_processes, netns_pids, tc_command)

INNER_IFNAME = "ml0"


def _exit_on_sigterm():
    """While hosts exist, SIGTERM (timeout(1), a CI runner cancelling the job) raises SystemExit
    instead of killing the process outright, so the clean-up in `hosts` still runs. Only where
    SIGTERM has its default action and in the main thread; returns the function that undoes it."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    def restore():
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return restore


@contextlib.contextmanager
def _machine_lock(timeout: float = 60.0):
    """An exclusive lock shared by every process on this machine (a file lock), bounded."""
    import fcntl

    with open(os.path.join("/tmp", "megalite-netns.lock"), "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetnsError(f"/tmp/megalite-netns.lock held for over {timeout:.0f} s")
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pick_subnet() -> ipaddress.IPv4Network:
    """10.77.X.0/24 with the first X that no address or route of the root namespace touches."""
    used = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", "table", "all",
                                                                    check=False).stdout
    for x in range(256):
        net = ipaddress.IPv4Network(f"10.77.{x}.0/24")
        if not any(ipaddress.IPv4Network(m, strict=False).overlaps(net)
                   for m in re.findall(r"\b(10\.77\.\d+\.\d+(?:/\d+)?)", used)):
            return net
    raise NetnsError("no free 10.77.X.0/24 subnet")


@dataclass
class Host:
    name: str  # the hostname (e.g. Slurm node name), resolvable inside every host
    netns: str
    addr: str
    veth: str  # root-namespace end
    ifname: str = INNER_IFNAME  # this host's end, inside its namespace
    procs: list = field(default_factory=list)
    link: LinkLimit | None = None  # the limit on this host's link (Host.limit), None: a bare veth

    def command(self, argv: list[str]) -> list[str]:
        return [ip_command(), "netns", "exec", self.netns, *argv]

    def popen(self, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start argv inside this host (`ip netns exec` execs it: the Popen's pid is argv's)."""
        p = subprocess.Popen(self.command(argv), env=env, **kw)
        self.procs.append(p)
        return p

    def run(self, argv: list[str], timeout: float = 60, env: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), env=env, timeout=timeout, capture_output=True, text=True,
                              **kw)

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    def kill_all(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> list[int]:
        """Every process in this host's namespace (a node whose processes all die: the kernel
        still closes their connections, so peers see them go at once)."""
        return kill_netns_processes(self.netns, sig, timeout)

    def unplug(self) -> None:
        """Take this host's link to the bridge down (a network partition: packets vanish, no
        connection is closed, so peers notice only through time-outs)."""
        _ip("link", "set", self.veth, "down")

    def plug(self) -> None:
        _ip("link", "set", self.veth, "up")

    def limit(self, link: LinkLimit | None) -> None:
        """Throttle this host's link in both directions (None: take the limit off)."""
        ends = ((self.veth, None), (self.ifname, self.netns))  # toward the host; from it
        for dev, ns in ends:
            if link is None:
                with contextlib.suppress(NetnsError):  # no qdisc of ours there: nothing to remove
                    _tc("qdisc", "del", "dev", dev, "root", netns=ns)
            else:
                _tc("qdisc", "replace", "dev", dev, "root", *link.tbf_args(), netns=ns)
        self.link = link

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (its interface's counter: Ethernet frames, TCP/IP
        headers included)."""
        stats = json.loads(_ip("-j", "-s", "link", "show", self.ifname, netns=self.netns).stdout)
        return int(stats[0]["stats64"]["tx"]["bytes"])

    def qdiscs(self) -> str:
        """`tc -s qdisc` of both ends (bytes sent, drops, overlimits), for reports."""
        return (_tc("-s", "qdisc", "show", "dev", self.veth).stdout
                + _tc("-s", "qdisc", "show", "dev", self.ifname, netns=self.netns).stdout)


@dataclass
class Network:
    bridge: str
    subnet: ipaddress.IPv4Network
    gateway: str  # the bridge's address: the root namespace as seen from the hosts
    hosts: list[Host]

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def limit(self, link: LinkLimit | None) -> None:
        """Throttle every host's link (None: take the limits off)."""
        for h in self.hosts:
            h.limit(link)

    def env(self) -> dict[str, str]:
        """The layout as environment variables (for scripts): MEGALITE_NETNS_HOSTS holds
        'name:netns:addr' per host, space separated."""
        return {"MEGALITE_NETNS_HOSTS": " ".join(f"{h.name}:{h.netns}:{h.addr}" for h in self.hosts),
                "MEGALITE_NETNS_GATEWAY": self.gateway, "MEGALITE_NETNS_IFNAME": INNER_IFNAME}

    def check(self, timeout: float = 10.0) -> None:
        """Every host reaches host 0 and the gateway over TCP (bounded: `timeout` seconds)."""
        listener = (
            "import socket,sys\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 0)); s.listen(16); s.settimeout(%r)\n"
            "print(s.getsockname()[1], flush=True)\n"
            "for _ in range(%d):\n"
            "    c, _a = s.accept(); c.close()\n" % (timeout, len(self.hosts)))
        server = self.hosts[0].popen([sys.executable, "-c", listener], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline().strip() or 0)
            if not port:
                raise NetnsError(f"no listener in {self.hosts[0].netns}: {server.stderr.read()[-500:]}")
            connect = ("import socket,sys\n"
                       "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=%r).close()\n" % timeout)
            for h in self.hosts:
                r = h.run([sys.executable, "-c", connect, self.hosts[0].addr, str(port)], timeout=timeout + 5)
                if r.returncode != 0:
                    raise NetnsError(
                        f"{h.netns} cannot reach {self.hosts[0].addr}:{port} over bridge {self.bridge}: "
                        f"{r.stderr.strip().splitlines()[-1:]}. If br_netfilter is loaded with an iptables "
                        f"FORWARD policy of DROP (Docker hosts), bridged traffic is filtered.")
            server.wait(timeout=timeout)
        finally:
            _stop(server)

    def throughput(self, sender: int = 1, receiver: int = 0, nbytes: int = 8 << 20, timeout: float = 60.0) -> float:
        """Bytes/s of one TCP stream from host `sender` to host `receiver`: `nbytes` sent, timed on
        the sender from the first byte to the receiver's acknowledgement of the last."""
        server_code = (
            "import socket,sys\n"
            "s=socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(1); s.settimeout(%r)\n"
            "print(s.getsockname()[1], flush=True)\n"
            "c, _a = s.accept(); c.settimeout(%r); n = 0\n"
            "while n < %d:\n"
            "    b = c.recv(1 << 20)\n"
            "    if not b: sys.exit('connection closed after %%d bytes' %% n)\n"
            "    n += len(b)\n"
            "c.sendall(b'k'); c.close()\n" % (timeout, timeout, nbytes))
        server = self.hosts[receiver].popen([sys.executable, "-c", server_code], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline().strip() or 0)
            if not port:
                raise NetnsError(f"no listener in {self.hosts[receiver].netns}: {server.stderr.read()[-500:]}")
            client_code = (
                "import socket,sys,time\n"
                "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=%r)\n"
                "buf = bytes(1 << 20); left = %d; t = time.perf_counter()\n"
                "while left > 0:\n"
                "    k = min(left, len(buf)); c.sendall(buf[:k]); left -= k\n"
                "assert c.recv(1) == b'k'\n"
                "print(time.perf_counter() - t)\n" % (timeout, nbytes))
            r = self.hosts[sender].run([sys.executable, "-c", client_code, self.hosts[receiver].addr, str(port)],
                                       timeout=timeout + 5)
            if r.returncode != 0:
                raise NetnsError(f"throughput test {sender} -> {receiver} failed: {r.stderr.strip()[-500:]}")
            server.wait(timeout=timeout)
            return nbytes / float(r.stdout.strip())
        finally:
            _stop(server)



def _stop(server: subprocess.Popen) -> None:
    """Kill a helper process if it still runs and close its pipes."""
    if server.poll() is None:
        server.kill()
        server.wait()
    for f in (server.stdout, server.stderr):
        f.close()

@contextlib.contextmanager
def hosts(n: int = 2, names: list[str] | None = None, tag: str = "t", check: bool = True,
          link: LinkLimit | None = None):
    """`n` hosts on a fresh bridge; yields a Network. `tag` (one letter) keeps the names of two
    networks of one process apart. `link` throttles every host's link (Network.limit). Everything
    is removed on exit, whatever the reason."""
    if not (len(tag) == 1 and tag.isalpha() and tag.islower()):
        raise ValueError("tag must be one lowercase letter")
    if n < 1 or n > 200:
        raise ValueError("1 <= n <= 200")
    names = list(names or [f"host{i}" for i in range(n)])
    if len(names) != n:
        raise ValueError(f"{n} hosts but {len(names)} names")
    if ip_command() is None:
        raise NetnsError("iproute2's `ip` is not installed (bash .ci/setup_netns.sh installs it)")
    if link is not None and tc_command() is None:
        raise NetnsError("iproute2's `tc` is not installed (bash .ci/setup_netns.sh installs iproute2)")
    stem = f"ml{tag}{os.getpid()}"
    bridge = f"{stem}br"
    if len(bridge) > 15 or len(f"{stem}v{n - 1}") > 15:
        raise NetnsError(f"interface names from pid {os.getpid()} exceed 15 characters")
    if stem in _ACTIVE:
        raise ValueError(f"a network with tag {tag!r} is already up in this process")
    restore = _exit_on_sigterm()
    try:
        with _hosts(n, names, stem, bridge, check, link) as net:
            yield net
    finally:
        restore()


@contextlib.contextmanager
def _hosts(n: int, names: list[str], stem: str, bridge: str, check: bool, link: LinkLimit | None):
    with _machine_lock():  # two test runs at once must not pick the same subnet
        clean_stale()
        subnet = _pick_subnet()
        addrs = list(subnet.hosts())
        gateway = str(addrs[0])  # .1
        net = Network(bridge, subnet, gateway, [
            Host(name=names[i], netns=f"{stem}h{i}", addr=str(addrs[9 + i]), veth=f"{stem}v{i}")
            for i in range(n)])
        _ACTIVE.add(stem)
        try:
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", bridge)
        except BaseException:
            teardown(net)
            _ACTIVE.discard(stem)
            raise
    try:
        _ip("link", "set", bridge, "up")
        hosts_file = _hosts_file(net)
        for h in net.hosts:
            _ip("netns", "add", h.netns)
            if not os.path.isdir(NETNS_ETC):
                os.makedirs(NETNS_ETC, exist_ok=True)
                _CREATED_ETC[0] = True
            os.makedirs(os.path.join(NETNS_ETC, h.netns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, h.netns, "hosts"), "w") as f:
                f.write(hosts_file)
            # No DNS server is reachable from a host: lookups that miss the hosts file fail at
            # once on the host's own loopback instead of waiting for a server on another network.
            with open(os.path.join(NETNS_ETC, h.netns, "resolv.conf"), "w") as f:
                f.write("# tests/netns.py: no DNS inside test hosts\nnameserver 127.0.0.1\n"
                        "options timeout:1 attempts:1\n")
            # The inner end is created directly in the namespace, under the same name in every host.
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.ifname, "netns", h.netns)
            _ip("link", "set", h.veth, "master", bridge)
            _ip("link", "set", h.veth, "up")
            _ip("link", "set", "lo", "up", netns=h.netns)
            _ip("addr", "add", f"{h.addr}/{subnet.prefixlen}", "dev", h.ifname, netns=h.netns)
            _ip("link", "set", h.ifname, "up", netns=h.netns)
        if link is not None:
            net.limit(link)
        if check:
            net.check()
        yield net
    finally:
        teardown(net)
        _ACTIVE.discard(stem)


def _hosts_file(net: Network) -> str:
    """The machine's /etc/hosts (localhost, its own name) plus every host's name."""
    try:
        with open("/etc/hosts") as f:
            base = f.read()
    except OSError:
        base = "127.0.0.1 localhost\n"
    if base and not base.endswith("\n"):
        base += "\n"
    return base + "# megalite test hosts (tests/netns.py)\n" + "".join(f"{h.addr} {h.name}\n" for h in net.hosts)


def teardown(net: Network) -> None:
    """Kill what runs in the hosts, then remove namespaces, veths, bridge and /etc/netns files."""
    for h in net.hosts:
        for p in h.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        with contextlib.suppress(Exception):
            _remove_netns(h.netns)
        with contextlib.suppress(Exception):
            _remove_link(h.veth)  # gone with the namespace already, normally
        for p in h.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
    with contextlib.suppress(Exception):
        _remove_link(net.bridge)
    if _CREATED_ETC[0]:
        with contextlib.suppress(OSError):  # only if we made it, and only when empty
            os.rmdir(NETNS_ETC)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="run a command with N network-namespace hosts around it")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--names", default=None, help="comma-separated host names (default host0,host1,...)")
    ap.add_argument("--tag", default="c")
    ap.add_argument("--rate-mbit", type=float, default=None, help="limit each host's link (both directions)")
    ap.add_argument("--burst-kib", type=float, default=None, help="tbf bucket (default: 2 ms of the rate)")
    ap.add_argument("--queue-ms", type=float, default=50.0, help="tbf latency: the queue's length, not a delay")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- command ... (MEGALITE_NETNS_* in its env)")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given")
    link = LinkLimit(a.rate_mbit, a.burst_kib, a.queue_ms) if a.rate_mbit else None
    with hosts(a.hosts, a.names.split(",") if a.names else None, tag=a.tag, link=link) as net:
        for h in net.hosts:
            limit = f", link {' '.join(link.tbf_args())}" if link else ""
            print(f"netns: {h.name} = {h.netns} {h.addr} ({h.ifname}{limit})", file=sys.stderr)
        print(f"netns: bridge {net.bridge} {net.gateway}/{net.subnet.prefixlen}", file=sys.stderr)
        child = subprocess.Popen(cmd, env={**os.environ, **net.env()})
        try:
            return child.wait()
        except KeyboardInterrupt:
            return 130
        finally:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
