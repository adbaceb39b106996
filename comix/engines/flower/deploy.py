"""Certificates, SuperNode keys and the Flower processes, for loopback demos, tests and the
deployment guide (docs/flower.md).

Security is on by default: the SuperLink serves TLS with a certificate signed by a CA made
here, and accepts only SuperNodes whose ECDSA public key was registered with
``flwr supernode register``. ``insecure=True`` turns both off and says so loudly.
Every process is started in its own session and stopped by process group, so the
``flower-superexec`` / ``flwr-clientapp`` children die with their parent.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...runtime import process_memory_mb

log = logging.getLogger("comix.flower")
APP_DIR = Path(__file__).parent / "app"


@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: str | Path, hosts=("127.0.0.1", "localhost"), days: int = 365) -> Certificates:
    """A CA and a server certificate for ``hosts`` signed by it (PEM files in ``directory``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, public_key, signing_key, ca: bool, sans=None):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signing_key, hashes.SHA256())

    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_cert = cert(name("comix CA"), name("comix CA"), ca_key.public_key(), ca_key, True)
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    server = cert(name(hosts[0]), ca_cert.subject, key.public_key(), ca_key, False, sans)
    pem = serialization.Encoding.PEM
    out = Certificates(d / "ca.crt", d / "server.pem", d / "server.key")
    out.ca.write_bytes(ca_cert.public_bytes(pem))
    out.cert.write_bytes(server.public_bytes(pem))
    out.key.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    out.key.chmod(0o600)
    (d / "ca.key").write_bytes(ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    (d / "ca.key").chmod(0o600)
    return out


def make_node_key(directory: str | Path, name: str) -> tuple[Path, Path]:
    """An ECDSA (NIST P-384) key pair for one SuperNode, OpenSSH format as Flower reads it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = d / name, d / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def named(pids: list[int], program: str) -> list[int]:
    """Those of ``pids`` running ``program`` (its file name, also as a Python script's first argument)."""
    out = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(Path(a.decode(errors="replace")).name == program for a in argv[:2]):
            out.append(pid)
    return out


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak so far (``VmHWM``) in MiB; 0 when gone."""
    return process_memory_mb(pid, field)


@dataclass
class Federation:
    """A SuperLink and SuperNodes on this machine (loopback), each process started by us and
    stopped by us."""
    workdir: Path
    insecure: bool = False
    procs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        self.home = self.workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.insecure:
            log.warning("INSECURE Flower federation: no TLS and no SuperNode authentication. "
                        "Use this only on a trusted loopback for debugging.")
            self.certs = None
        else:
            self.certs = make_certificates(self.workdir / "certificates")
        conn = [f'[superlink]\ndefault = "comix"\n\n[superlink.comix]\naddress = "{self.address}"']
        conn.append("insecure = true" if self.insecure else f'root-certificates = "{self.certs.ca}"')
        (self.home / "config.toml").write_text("\n".join(conn) + "\n")

    def _start(self, key: str, args: list[str]) -> subprocess.Popen:
        logf = open(self.workdir / f"{key}.log", "ab")
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.workdir, start_new_session=True)
        self.procs[key] = proc
        return proc

    def log_of(self, key: str) -> str:
        f = self.workdir / f"{key}.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def start_superlink(self, timeout: float = 60) -> None:
        args = [_bin("flower-superlink"), "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.insecure:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(self.certs.ca), "--ssl-certfile", str(self.certs.cert),
                     "--ssl-keyfile", str(self.certs.key), "--enable-supernode-auth"]
        self._start("superlink", args)
        deadline = time.time() + timeout
        while "Starting Flower SuperExec" not in self.log_of("superlink"):
            if time.time() > deadline or self.procs["superlink"].poll() is not None:
                raise RuntimeError(f"flower-superlink did not start:\n{self.log_of('superlink')[-2000:]}")
            time.sleep(0.3)

    def flwr(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_bin("flwr"), *args], env=self.env, cwd=self.workdir, capture_output=True,
                              text=True, timeout=timeout)

    def register(self, public_key: Path) -> None:
        res = self.flwr("supernode", "register", str(public_key), "comix", timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"flwr supernode register failed: {res.stdout}{res.stderr}")

    def start_supernode(self, client: int, node_config: dict, register: bool = True, ca: bool = True,
                        key: Path | None = None) -> subprocess.Popen:
        """One device. With auth on, a fresh key pair is made and (unless ``register=False``)
        registered; ``ca=False`` starts it without the CA certificate (it cannot connect)."""
        args = [_bin("flower-supernode"), "--superlink", self.address, "--port", str(free_port()),
                "--node-config", " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}"
                                          for k, v in {"client-id": client, **node_config}.items())]
        if self.insecure:
            args.append("--insecure")
        else:
            if ca:
                args += ["--root-certificates", str(self.certs.ca)]
            if key is None:
                key, public = make_node_key(self.workdir / "keys", f"node{client}")
                if register:
                    self.register(public)
            args += ["--auth-supernode-private-key", str(key)]
        return self._start(f"supernode{client}", args)

    def nodes(self) -> list[dict]:
        """The SuperNodes the SuperLink knows (``flwr supernode list``)."""
        import json
        res = self.flwr("supernode", "list", "comix", "--format", "json", timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"flwr supernode list failed: {res.stdout}{res.stderr}")
        return json.loads(res.stdout).get("nodes", [])

    def run(self, run_config: dict, app: Path = APP_DIR, timeout: float | None = None) -> subprocess.CompletedProcess:
        """``flwr run`` the app and stream its logs until the run ends."""
        cfg = " ".join(f'{k}="{v}"' if isinstance(v, (str, Path)) else f"{k}={v}" for k, v in run_config.items())
        return self.flwr("run", str(app), "comix", "--run-config", cfg, "--stream", timeout=timeout)

    def serverapps(self) -> list[int]:
        """The ServerApp processes the SuperLink started (``flwr-serverapp``, one per running run)."""
        return named(_descendants(self.procs["superlink"].pid), "flwr-serverapp")

    def kill_serverapp(self) -> int:
        """SIGKILL the running ServerApp (a crashed server: no clean-up of its own); how many died.
        Its run is over; ``flwr run`` with the same run config starts a new one that continues from
        the run directory's checkpoint (``engines.server.serve`` resumes)."""
        pids = self.serverapps()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self, key: str | None = None) -> None:
        """Stop one process (e.g. ``supernode1``) or all, with their children (also those that
        started a session of their own)."""
        for k in ([key] if key else list(self.procs)):
            proc = self.procs.pop(k, None)
            if proc is None:
                continue
            family = _descendants(proc.pid)
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):  # KILL: children that stayed
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
