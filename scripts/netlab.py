"""Hosts on one machine, joined by links of a given rate: the multi-host
harness of the tests and benches (root only).

``Hosts(n, rate="1gbit")`` makes ``n`` network namespaces (one per host),
each with an interface ``eth0`` at 10.77.0.(i+1)/24 joined by a veth pair
to a bridge in a switch namespace of its own, every link rate-limited both
ways with tbf (this kernel has no netem): ``tc qdisc add dev X root tbf
rate RATE burst 512kb latency 100ms``. Nothing else is reachable from the
hosts and no traffic touches the machine's own namespace. ``run(i, argv)``
starts a process on host i, ``mpirun(argv)`` one MPI rank on every host
(Open MPI over TCP), ``torchrun(argv, port)`` one torch.distributed
rank on every host; ``cut(i)`` / ``restore(i)`` take a host's link down
and up; ``rx_bytes(i)`` counts what its link delivered. The
namespaces go however a run ends (``close()``, a context manager, atexit,
SIGTERM); ``python scripts/netlab.py clean`` removes any a killed run left.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

PREFIX = "esnl"
SUBNET = "10.77.0"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """Why the harness cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"needs {tool}"
    return None


class Hosts:
    """``n`` hosts joined through one switch by links of ``rate`` (a tc
    rate: "1gbit", "10gbit"); ``rates`` gives some hosts links of their
    own rate (``{0: "10gbit"}``: a source whose uplink is faster)."""

    def __init__(self, n: int, rate: str = "1gbit", rates: dict[int, str] | None = None) -> None:
        why = available()
        if why:
            raise RuntimeError(f"netlab: {why}")
        self.n, self.rate = n, rate
        self.rates = {i: (rates or {}).get(i, rate) for i in range(n)}
        self.tag = f"{PREFIX}{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        self._dirs: list[str] = []
        self._closed = False
        atexit.register(self.close)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _on_term(self, signum: int, frame: Any) -> None:
        self.close()
        sys.exit(128 + signum)

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            peer = f"p{i}"
            veth = ["type", "veth", "peer", "name", peer, "netns", self.switch]
            _ip("link", "add", "eth0", *veth, ns=ns)
            _ip("addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", peer, "master", "br0", ns=self.switch)
            _ip("link", "set", peer, "up", ns=self.switch)
            for dev, where in (("eth0", ns), (peer, self.switch)):
                subprocess.run(
                    ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                     "tbf", "rate", self.rates[i], "burst", "512kb", "latency", "100ms"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip

    def addr(self, i: int) -> str:
        """Host i's address."""
        return f"{SUBNET}.{i + 1}"

    def run(self, i: int, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` on host i (killed at close)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **popen)
        self.procs.append(p)
        return p

    def mpirun(self, argv: list[str], env: dict[str, str] | None = None, **popen: Any) -> Any:
        """Starts ``argv`` as one MPI rank on each host, over Open MPI's TCP
        transport: ``mpirun`` runs on host 0 and reaches the others through
        an rsh agent that enters each host's namespace (and a UTS namespace
        named after it: ranks on one hostname would use shared memory), with
        a hostfile of the hosts' addresses and the TCP interfaces pinned to
        ``eth0`` (a plain MPMD launch into namespaces fails in MPI_Init).
        Ranks are not bound to cores: each host's daemon would bind its
        rank to the first core, and the hosts share this machine's cores."""
        work = tempfile.mkdtemp(prefix=f"{self.tag}-mpi-")
        self._dirs.append(work)
        mapfile, agent, hostfile = (os.path.join(work, n) for n in ("map", "agent", "hosts"))
        with open(mapfile, "w") as f:
            f.writelines(f"{self.addr(i)} {ns}\n" for i, ns in enumerate(self.names))
        with open(hostfile, "w") as f:
            f.writelines(f"{self.addr(i)} slots=1\n" for i in range(self.n))
        with open(agent, "w") as f:
            f.write(
                "#!/bin/bash\n"
                'while [ "${1#-}" != "$1" ]; do shift; done\n'
                "host=$1; shift\n"
                f"ns=$(grep \"^$host \" {mapfile} | cut -d' ' -f2)\n"
                'exec ip netns exec "$ns" unshare --uts bash -c "hostname $ns; $*"\n'
            )
        os.chmod(agent, 0o755)
        mpirun = " ".join(
            [
                "mpirun", "--hostfile", hostfile, "-n", str(self.n),
                "--mca", "plm_rsh_agent", agent, "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
                "--prtemca", "oob_tcp_if_include", "eth0", "--mca", "mpi_yield_when_idle", "1",
                "--bind-to", "none",
                *(shlex.quote(a) for a in argv),
            ]
        )  # fmt: skip
        e = {
            **os.environ,
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            **(env or {}),
        }
        cmd = ["unshare", "--uts", "bash", "-c", f"hostname {self.names[0]}; exec {mpirun}"]
        return self.run(0, cmd, env=e, **popen)

    def torchrun(
        self, argv: list[str], port: int, env: dict[str, str] | None = None, **popen: Any
    ) -> list[subprocess.Popen[Any]]:
        """Starts ``argv`` on every host as one rank of a torch.distributed
        job (gloo over ``eth0``, the store on host 0 at ``port``), as
        torchrun's environment would; the processes, by rank."""
        return [
            self.run(
                r,
                argv,
                env={
                    **os.environ,
                    "RANK": str(r),
                    "WORLD_SIZE": str(self.n),
                    "MASTER_ADDR": self.addr(0),
                    "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": "eth0",
                    **(env or {}),
                },
                **popen,
            )
            for r in range(self.n)
        ]

    def launch(
        self, transport: str, argv: list[str], port: int, env: dict[str, str], **popen: Any
    ) -> list[Any]:
        """Starts ``argv`` as one rank on every host: over MPI (``transport``
        "mpi": :meth:`mpirun`, this process's PYTHONPATH passed on) or
        torch.distributed (:meth:`torchrun`, its store at ``port``); the
        processes to wait for."""
        if transport == "mpi":
            path = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
            return [self.mpirun(argv, env={**env, **path}, **popen)]
        return self.torchrun(argv, port, env, **popen)

    def cut(self, i: int) -> None:
        """Takes host i's link down (its connections fail at once)."""
        _ip("link", "set", "eth0", "down", ns=self.names[i])

    def restore(self, i: int) -> None:
        """Brings host i's link back up."""
        _ip("link", "set", "eth0", "up", ns=self.names[i])

    def rx_bytes(self, i: int) -> int:
        """Bytes host i's interface has received."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.names[i], "cat", "/sys/class/net/eth0/statistics/rx_bytes"],  # noqa: E501
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return int(out.stdout)

    def close(self) -> None:
        """Kills the hosts' processes and removes the namespaces."""
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        if signal.getsignal(signal.SIGTERM) == self._on_term:
            signal.signal(signal.SIGTERM, self._old_term)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rate_bytes(rate: str) -> float:
    """Bytes a second of a tc rate ("1gbit", "100mbit")."""
    for unit, scale in {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"rate: expected e.g. 1gbit or 100mbit, got {rate!r}")


def maxall(via: str) -> Any:
    """For a bench's rank: the function that returns the elementwise max of
    a float64 array over every rank, over MPI's COMM_WORLD (``via="mpi"``)
    or torch.distributed's default group (``"torch"``)."""
    import numpy as np

    if via == "mpi":
        from mpi4py import MPI

        def over_mpi(a: np.ndarray) -> np.ndarray:
            out = np.empty_like(a)
            MPI.COMM_WORLD.Allreduce(a, out, op=MPI.MAX)
            return out

        return over_mpi
    import torch
    import torch.distributed as dist

    def over_torch(a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a.copy())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out: np.ndarray = t.numpy()
        return out

    return over_torch


def clean() -> int:
    """Removes every namespace a harness run left behind."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    gone = 0
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone += 1
    return gone


if __name__ == "__main__":
    if sys.argv[1:] == ["clean"]:
        print(f"removed {clean()} namespaces")
    else:
        print(__doc__)
