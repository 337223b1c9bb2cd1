"""Local servers for tests and benchmarks: redis-server and mooncake_master on free loopback ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port(below: int = 65536) -> int:
    """A free loopback port under `below` (Redis Cluster also binds port + 10000 for its bus)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


def wait_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


def wait_port_in(netns: str | None, port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    """wait_port, asked from inside a network namespace (None: this one)."""
    if netns is None:
        return wait_port(port, timeout, host)
    code = f"from kvprefetch.testbed.local_servers import wait_port; wait_port({port}, {timeout}, {host!r})"
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise TimeoutError(f"nothing listens on port {port} in network namespace {netns}: {out.stderr[-500:]}")


def tls_files(workdir: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (openssl's CLI): (ca, cert, key)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is not installed")
    ca_key, ca, key, csr, cert, ext = (workdir / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt",
                                                             "ext.cnf"))  # fmt: skip
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
                  "-keyout", ca_key, "-out", ca],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
                  "-extfile", ext, "-out", cert]):  # fmt: skip
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    return ca, cert, key


def tls_args(tls_port: int, ca: Path, cert: Path, key: Path) -> list[str]:
    """redis-server's arguments to also serve TLS on tls_port (clients need not present a certificate)."""
    return ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]  # fmt: skip


class RedisServer:
    """A throwaway redis-server (no persistence) that tests may kill and restart on the same port; on loopback,
    or inside network namespace `netns` on every address there (other namespaces reach it at `url_at(ip)`)."""

    def __init__(self, workdir: Path, *extra: str, netns: str | None = None):
        self.netns = netns
        self.exe = shutil.which("redis-server")
        cluster = "--cluster-enabled" in extra
        if self.exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; `make setup` does)")
        self.port, self.workdir, self.extra = free_port(below=55535 if cluster else 65536), workdir, extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return self.url_at("127.0.0.1")

    def url_at(self, host: str, db: int = 0) -> str:
        return f"redis://{host}:{self.port}/{db}"

    def start(self) -> None:
        bind = "127.0.0.1" if self.netns is None else "0.0.0.0"
        cmd = [self.exe, "--port", str(self.port), "--bind", bind, "--save", "", "--appendonly", "no",
               "--protected-mode", "no", "--dir", str(self.workdir), *self.extra]  # fmt: skip
        if self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port_in(self.netns, self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class MooncakeMaster:
    """mooncake_master with its embedded HTTP metadata server, on loopback, or inside network namespace `netns`
    bound to `host` there (an address every client can route to: other namespaces reach it at `master`)."""

    def __init__(self, workdir: Path, *extra: str, netns: str | None = None, host: str = "127.0.0.1"):
        exe = Path(sys.executable).with_name("mooncake_master")
        if not exe.exists():
            raise RuntimeError("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.exe, self.workdir, self.extra, self.netns, self.host = exe, workdir, extra, netns, host
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def master(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self) -> None:
        h = self.host
        cmd = [str(self.exe), f"-rpc_port={self.rpc_port}", "-enable_http_metadata_server=true",
               f"-http_metadata_server_port={self.http_port}", f"-http_metadata_server_host={h}",
               f"-metrics_port={self.metrics_port}", f"-rpc_address={h}", *self.extra]  # fmt: skip
        if self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=h)
        log = open(self.workdir / "mooncake_master.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        for port in (self.rpc_port, self.http_port):
            wait_port_in(self.netns, port, host=h)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
