"""Deployment (issue 14, item 10): mount options defined once, `mount -t fuse.kvfs` and fstab,
systemd readiness, the mount's source in df, bounded logs, and the operator's rough edges."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs import mount_options, mountctl
from kvfs.cli import build_parser
from kvfs.config import MountConfig, daemon_log
from kvfs.mount.daemon import build_parser as daemon_parser
from kvfs.mount.daemon import parse_config
from tests.conftest import KVFS, SESSION_OPTIONS, Mount, kvfs, make_mount, wait_gone

SESSION = dict(zip(SESSION_OPTIONS[::2], SESSION_OPTIONS[1::2], strict=True)).get("--session")
HELPER = Path(sys.executable).parent / "mount.fuse.kvfs"
SBIN_HELPER = Path("/sbin/mount.fuse.kvfs")


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount the test starts itself (any way it likes); always unmounted after."""
    mount = make_mount(tmp_path)
    try:
        yield mount
    finally:
        mount.stop()


def one_line_refusal(done: subprocess.CompletedProcess[str], words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and words in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def capacity(path: Path) -> int:
    return int(os.getxattr(path, "user.kvfs.capacity"))


# -- mount options, defined once ---------------------------------------------------------------


def _mount_parser_flags() -> dict[str, str]:
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return {flag: a.help or "" for a in commands["mount"]._actions for flag in a.option_strings}


def test_every_option_is_on_the_command_line_and_the_daemon_with_its_default() -> None:
    cli = _mount_parser_flags()
    daemon = {flag for a in daemon_parser()._actions for flag in a.option_strings}
    for option in mount_options.OPTIONS:
        assert option.flag in cli and "(default " in cli[option.flag], option.name
        assert (option.flag in daemon) == option.daemon, option.name
    assert "--cache-timeout" in cli and "--read-threads" in cli  # were on the daemon, or nowhere


def test_the_daemon_argv_carries_every_value_back() -> None:
    cfg = MountConfig(
        Path("/m"),
        Path("/b"),
        write_buffer_bytes=3 << 20,
        io_timeout=2.5,
        capacity="40%",
        eviction="arc",
        metrics_port=9999,
        metrics_address="0.0.0.0",
        events="tcp://127.0.0.1:5557",
        fuse_options=("allow_other",),
        file_umask=0o077,
        session="kernel",
        verify="first-read",
        scrub_bytes_per_second=0,
        cache_timeout=5.0,
        read_threads=3,
        write_threads=2,
    )
    argv = ["/m", "--backing", "/b", *mount_options.daemon_argv(cfg)]
    assert parse_config(argv) == cfg
    assert parse_config(["/m", "--backing", "/b"]) == MountConfig(Path("/m"), Path("/b"))


def test_dash_o_takes_every_mount_option(mount: Mount) -> None:
    where = (str(mount.path), "--backing", str(mount.backing), *SESSION_OPTIONS)
    kvfs("mount", *where, "-o", "capacity=64M,cache_timeout=1", "-o", "umask=077,allow_other")
    mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
    assert capacity(mount.path) == 64 << 20
    with open(f"/proc/{mount.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert {b"--umask=077", b"--cache-timeout=1", b"--fuse-option=allow_other"} <= set(argv)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (("--capacity", "1G", "-o", "capacity=2G"), "--capacity 1G and -o capacity=2G"),
        (("-o", "capacity"), "-o capacity: not accepted"),
        (("-o", "supervise=1"), "-o supervise=1: not accepted"),
        (("-o", "io_timeout=soon"), "--io-timeout: 'soon' is not a number of seconds"),
        (("-o", "read-threads=0"), "read_threads: must be between 1 and 256"),
    ],
)
def test_bad_mount_options_are_one_line(
    tmp_path: Path, options: tuple[str, ...], words: str
) -> None:
    mount = make_mount(tmp_path)
    done = kvfs("mount", str(mount.path), "--backing", str(mount.backing), *options, check=False)
    one_line_refusal(done, words)
    assert mountctl.mount_stack(str(mount.path)) == []


# -- mount -t fuse.kvfs, and fstab ---------------------------------------------------------------


@pytest.fixture
def helper_in_sbin() -> Iterator[None]:
    """mount(8) runs /sbin/mount.fuse.kvfs (what `make install` links there)."""
    assert HELPER.exists(), f"{HELPER} is missing: pip install -e . (make) creates it"
    if SBIN_HELPER.is_symlink() or SBIN_HELPER.exists():
        if SBIN_HELPER.resolve() != HELPER.resolve():
            pytest.skip(f"{SBIN_HELPER} is another kvfs's helper")
        yield
        return
    SBIN_HELPER.symlink_to(HELPER)
    try:
        yield
    finally:
        SBIN_HELPER.unlink()


def _session_o() -> str:
    return f",session={SESSION}" if SESSION else ""


@pytest.mark.usefixtures("helper_in_sbin")
def test_mount_t_fuse_kvfs_mounts_with_kvfs_options(mount: Mount) -> None:
    options = f"capacity=64M,umask=077,rw,nofail,_netdev,x-systemd.requires=a.mount{_session_o()}"
    done = subprocess.run(
        ["mount", "-t", "fuse.kvfs", str(mount.backing), str(mount.path), "-o", options],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
    assert capacity(mount.path) == 64 << 20
    (mount.path / "chunk.bin").write_bytes(b"x" * 4096)
    assert (mount.path / "chunk.bin").read_bytes() == b"x" * 4096
    kvfs("umount", str(mount.path))
    wait_gone(mount.pid)
    assert mountctl.mount_stack(str(mount.path)) == []
    assert (mount.backing / "chunk.bin").stat().st_size == 4096


@pytest.mark.usefixtures("helper_in_sbin")
def test_an_fstab_line_mounts(mount: Mount, tmp_path: Path) -> None:
    fstab = tmp_path / "fstab"
    fstab.write_text(
        f"{mount.backing} {mount.path} fuse.kvfs capacity=32M,nofail{_session_o()} 0 0\n"
    )
    done = subprocess.run(
        ["mount", "--fstab", str(fstab), str(mount.path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
    assert capacity(mount.path) == 32 << 20


@pytest.mark.usefixtures("helper_in_sbin")
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ("capacity=0", "--capacity: '0' is less than 1M"),
        ("bogus,nofail", "-o bogus: not accepted (accepted: allow_other"),
        ("eviction=mru", "eviction: 'mru' is not one of"),
    ],
)
def test_mount_t_fuse_kvfs_refuses_bad_options(tmp_path: Path, options: str, words: str) -> None:
    mount = make_mount(tmp_path)
    done = subprocess.run(
        ["mount", "-t", "fuse.kvfs", str(mount.backing), str(mount.path), "-o", options],
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line_refusal(done, words)
    assert mountctl.mount_stack(str(mount.path)) == []


# -- systemd readiness -----------------------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_foreground_daemon_notifies_systemd_once_the_mount_answers(
    mount: Mount, tmp_path: Path, abstract: bool
) -> None:
    name = f"@kvfs-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else ""
    address = "\0" + name[1:] if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(60)
        env = {**os.environ, "NOTIFY_SOCKET": name or address}
        args = [str(mount.path), "--backing", str(mount.backing), "--foreground"]
        proc = subprocess.Popen(
            [*KVFS, "mount", *args, *SESSION_OPTIONS],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            ready = sock.recv(4096).decode().split("\n")
            # Already mounted and answering the moment READY=1 arrives.
            assert "fuse.kvfs" in [kind for kind, _ in mountctl.mount_stack(str(mount.path))]
            os.statvfs(mount.path)
            mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
            assert ready[0] == "READY=1" and f"MAINPID={proc.pid}" in ready
            assert mount.pid == proc.pid  # kvfs mount --foreground execs the daemon
            assert any(f.startswith("STATUS=serving") for f in ready)
            kvfs("umount", str(mount.path))
            assert sock.recv(4096).decode().startswith("STOPPING=1")
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                mount.stop()
                proc.kill()
            proc.wait()


# -- where the mount shows, and what it refuses ---------------------------------------------------


def test_df_and_findmnt_show_the_backing_directory(mount: Mount) -> None:
    mount.start()
    found = subprocess.run(
        [
            "findmnt",
            "-n",
            "-o",
            "SOURCE,FSTYPE",
            "-t",
            "fuse.kvfs",
            "--mountpoint",
            str(mount.path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.split() == [str(mount.backing), "fuse.kvfs"]
    df = subprocess.run(["df", "-T", str(mount.path)], capture_output=True, text=True, check=True)
    assert df.stdout.splitlines()[1].split()[:2] == [str(mount.backing), "fuse.kvfs"]
    assert str(mount.path) in mountctl.kvfs_mounts()


def test_the_root_of_another_kvfs_mount_as_backing_is_refused(
    kv_mount: Mount, tmp_path: Path
) -> None:
    """Issue 14, item 10: it failed with "Read-only file system" (its `.kvfs` is the other
    daemon's control directory). A directory below that root works: test_deadlines stacks so."""
    mount = make_mount(tmp_path)
    done = kvfs("mount", str(mount.path), "--backing", str(kv_mount.path), check=False)
    one_line_refusal(done, "is the root of another kvfs mount")
    assert mountctl.mount_stack(str(mount.path)) == []


def test_ls_l_of_the_control_directory_is_clean(kv_mount: Mount) -> None:
    for command in (["ls", "-l"], ["ls", "-la"]):
        done = subprocess.run(
            [*command, str(kv_mount.path / ".kvfs")], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert "usage.json" in done.stdout


# -- logs -------------------------------------------------------------------------------------


def test_a_large_log_is_rotated_at_mount(mount: Mount) -> None:
    log = daemon_log(mount.path)
    log.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    old = Path(f"{log}.1")
    try:
        with open(log, "wb") as f:
            f.truncate(mountctl.LOG_ROTATE_BYTES + 1)
        mount.start()
        assert old.stat().st_size == mountctl.LOG_ROTATE_BYTES + 1
        assert log.stat().st_size < 1 << 20
    finally:
        old.unlink(missing_ok=True)


def test_logs_of_old_mountpoints_are_bounded(mount: Mount) -> None:
    folder = daemon_log(mount.path).parent
    folder.mkdir(mode=0o750, parents=True, exist_ok=True)
    stale = [folder / f"tmp_kvfs-stale-{os.getpid()}-{i}_mnt.log" for i in range(40)]
    try:
        for i, path in enumerate(stale):
            path.write_text("an old run\n")
            os.utime(path, (1e9 + i, 1e9 + i))  # 2001: older than any other log there
        mount.start()
        assert not any(p.exists() for p in stale[:8])  # the oldest go first, past 32 kept
    finally:
        for path in stale:
            path.unlink(missing_ok=True)
