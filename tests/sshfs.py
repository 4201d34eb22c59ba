"""A real shared filesystem on one machine: an sshd on 127.0.0.1 serving one directory over
SFTP, and sshfs mounts of it, one per stand-in host (each its own FUSE superblock, its own
SSH connection and its own sshfs caches, as two machines would have).

The sshd is started for the test and stopped after it, whatever happens: a host key and a
client key made for the run, that client key alone in its authorized_keys, root login by key
only (no password, no keyboard-interactive), listening on 127.0.0.1 and nothing else.
Where sshd, sshfs or FUSE cannot run, ``Unavailable`` says exactly why (the tests skip, or
fail where they must run: ``skip_or_fail``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

from kvfs import mountctl

# What a cache shared through sshfs needs (measured; docs/research/fleet-design.md, "Real
# shared filesystems"):
# - dir_cache=no: sshfs's own cache of names and attributes off (by default it keeps a stat
#   for 20 s, so a file another host removed is found that long after);
# - entry_timeout=0, attr_timeout=0: the kernel's caches of the sshfs mount off as well (1 s
#   by default), so every stat kvfs makes of the backing directory asks the server, and the
#   miss bound is kvfs's own (MISS_TIMEOUT) with nothing added; negative_timeout=0 is
#   libfuse's default, kept explicit: a miss is never cached below kvfs;
# - direct_io: a write() of up to sshfs's write size (32 KiB) reaches the server as one SFTP
#   write. Through the page cache the kernel splits a write at a 4 KiB page boundary, and another
#   host's O_APPEND write can land between the halves (a torn journal line). kvfs keeps its
#   own page cache above, so nothing measurable is lost.
SHARED_OPTIONS = (
    "dir_cache=no",
    "entry_timeout=0",
    "attr_timeout=0",
    "negative_timeout=0",
    "direct_io",
)

SBIN = "/usr/sbin:/usr/bin:/sbin:/bin"


class Unavailable(Exception):
    """sshd or sshfs cannot run here; the message says why."""


def skip_or_fail(why: Unavailable) -> NoReturn:
    """Skip where sshd or sshfs cannot run; fail under `make test`, which installs both
    (KVFS_TEST_SSHFS=required): a share that stopped mounting must not pass for a machine
    without one."""
    if os.environ.get("KVFS_TEST_SSHFS") == "required":
        pytest.fail(f"the sshfs share did not start: {why}")
    pytest.skip(f"no sshfs share here: {why}")


def _binary(name: str, package: str) -> str:
    found = shutil.which(name, path=SBIN)
    if found is None:
        raise Unavailable(f"{name} not found (Debian package {package}; `make apt` installs it)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every TCP socket listening on ``port`` (IPv4 and IPv6), as
    /proc/net/tcp{,6} spell them (hex)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class SshServer:
    """An sshd of the test's own on 127.0.0.1, root by key only."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.clients: dict[Path, SshfsMount] = {}  # by mountpoint

    def start(self) -> SshServer:
        if os.geteuid() != 0:
            raise Unavailable("not root: the sshd serves root by key, and kvfs mounts need root")
        sshd = _binary("sshd", "openssh-server")
        keygen = _binary("ssh-keygen", "openssh-client")
        self.home.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o700)
        for key in ("host_key", "client_key"):
            args = [keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"kvfs-test-{key}"]
            subprocess.run([*args, "-f", str(self.home / key)], check=True, timeout=30)
        shutil.copy(self.home / "client_key.pub", self.home / "authorized_keys")
        os.chmod(self.home / "authorized_keys", 0o600)
        # sshd's privilege separation directory: root's, not writable by others.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.port = _free_port()
        (self.home / "sshd_config").write_text(
            f"Port {self.port}\n"
            "ListenAddress 127.0.0.1\n"
            "AddressFamily inet\n"
            f"HostKey {self.home / 'host_key'}\n"
            f"PidFile {self.home / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.home / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitEmptyPasswords no\n"
            "UsePAM no\n"
            # The keys live in a 0700 directory of the test's under /tmp (world-writable,
            # which StrictModes refuses on the path to authorized_keys).
            "StrictModes no\n"
            "AllowUsers root\n"
            "AllowTcpForwarding no\n"
            "AllowAgentForwarding no\n"
            "X11Forwarding no\n"
            "PermitTunnel no\n"
            "Subsystem sftp internal-sftp\n"
            "LogLevel ERROR\n"
        )
        host_key = (self.home / "host_key.pub").read_text().split()
        (self.home / "known_hosts").write_text(
            f"[127.0.0.1]:{self.port} {' '.join(host_key[:2])}\n"
        )
        cfg = str(self.home / "sshd_config")
        check = subprocess.run([sshd, "-t", "-f", cfg], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise Unavailable(f"sshd refuses its test configuration: {check.stderr.strip()}")
        log = open(self.home / "sshd.log", "wb")  # noqa: SIM115 (kept for the process's life)
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", cfg], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"sshd did not start: {self.log().strip() or 'no output'}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        path = self.home / "sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def client_options(self) -> tuple[str, ...]:
        """ssh options for sshfs: this server's key only, this client key only, no prompts."""
        return (
            f"port={self.port}",
            f"IdentityFile={self.home / 'client_key'}",
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={self.home / 'known_hosts'}",
            "StrictHostKeyChecking=yes",
            "BatchMode=yes",
            "PasswordAuthentication=no",
            "ControlMaster=no",
        )


class SshfsMount:
    """One host's sshfs mount of ``remote`` (a directory on the server), run in the
    foreground so the test owns its process."""

    def __init__(self, server: SshServer, remote: Path, path: Path, options: tuple[str, ...]):
        self.server, self.remote, self.path, self.options = server, remote, path, options
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SshfsMount:
        sshfs = _binary("sshfs", "sshfs")
        if not os.path.exists("/dev/fuse"):
            raise Unavailable("no /dev/fuse: sshfs is a FUSE filesystem")
        self.path.mkdir(parents=True, exist_ok=True)
        opts = ",".join((*self.server.client_options(), *self.options))
        args = [sshfs, f"root@127.0.0.1:{self.remote}", str(self.path), "-f", "-F", "/dev/null"]
        self.log = self.path.with_name(f"{self.path.name}.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*args, "-o", opts], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while not (mountctl.mount_stack(str(self.path)) and self._answers()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                output = self.log.read_text(errors="replace").strip()
                raise Unavailable(f"sshfs did not mount: {output or 'no output'}")
            time.sleep(0.05)
        self.server.clients[self.path] = self
        return self

    def _answers(self) -> bool:
        try:
            os.statvfs(self.path)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        for _ in mountctl.mount_stack(str(self.path)):
            done = subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
        if self.proc is not None:
            _stop(self.proc)


@contextmanager
def shared_sshfs(
    tmp: Path, hosts: tuple[str, ...], options: tuple[str, ...] = SHARED_OPTIONS
) -> Iterator[tuple[SshServer, Path, dict[str, Path]]]:
    """An sshd serving ``tmp/server``, and one sshfs mount of it per host name
    (``tmp/<host>.sshfs``): (server, the served directory, {host: its sshfs mount}).
    Everything is unmounted and stopped afterwards, on failure too."""
    served = tmp / "server"
    served.mkdir()
    with ExitStack() as stack:
        server = SshServer(tmp / "sshd")
        stack.callback(server.stop)
        server.start()
        mounts = {}
        for host in hosts:
            mount = SshfsMount(server, served, tmp / f"{host}.sshfs", options)
            stack.callback(mount.stop)
            mounts[host] = mount.start().path
        yield server, served, mounts
