"""`kvfs mount` / `kvfs umount`: detaching, and a clear one-line error with nothing mounted."""

from __future__ import annotations

import argparse
import ctypes.util
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs import mountctl
from kvfs.cli import build_parser
from kvfs.config import daemon_log
from tests.conftest import Mount, flip_byte, kvfs, make_mount
from tools import vllm_io


def assert_refused(result: subprocess.CompletedProcess[str], words: str, mnt: Path) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfs: ") and words in lines[0], lines
    assert str(mnt) not in mountctl.kvfs_mounts()


def test_mount_returns_once_the_mount_answers_and_umount_waits_for_the_daemon(
    tmp_path: Path,
) -> None:
    mount = make_mount(tmp_path)
    result = kvfs("mount", str(mount.path), "--backing", str(mount.backing))
    try:
        assert f"mounted {mount.path}" in result.stdout
        (mount.path / "f").write_bytes(b"at once")  # usable on the very next line
        mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
        kvfs("umount", str(mount.path))
        assert not mountctl.running(mount.pid)
        assert (mount.backing / "f").read_bytes() == b"at once"
    finally:
        mount.stop()


def test_the_default_mount_as_root_is_kvfs_own_session_and_passes_verified_reads_through(
    tmp_path: Path,
) -> None:
    """`kvfs mount MNT` as root on a local backing directory: kvfs's own session (the kernel
    writes new chunks into their backing files itself; misses answered without a thread hop)
    with the default --verify first-read (the kernel reads a chunk this daemon published, or
    verified since, straight from its backing file; one changed around the mount since is
    served and checked at its next open: EIO, never its new bytes)."""
    mount = make_mount(tmp_path)
    kvfs("mount", str(mount.path), "--backing", str(mount.backing))
    try:
        mount.pid = int(os.getxattr(mount.path, "user.kvfs.pid"))
        session = mount.usage()["session"]
        assert session["name"] == "kernel" and session["passthrough"], session
        assert "session: kernel (root, backing store on" in daemon_log(mount.path).read_text()
        path = vllm_io.chunk_path(str(mount.path), 1)
        chunk = vllm_io.chunk(1, 1 << 20)  # (aligned, for O_DIRECT)
        assert vllm_io.store(path, chunk, o_direct=True)
        assert vllm_io.load(path, 1 << 20, o_direct=True) == chunk[:]
        assert mount.usage()["counters"].get("bytes_read", 0) == 0  # passed through
        flip_byte(mount.on_backing(path))
        with pytest.raises(OSError) as err:
            vllm_io.load(path, 1 << 20, o_direct=True)
        # EIO from the open that checks it; ENOENT where the default scrub (a pass about
        # every second) found it first on a loaded machine and quarantined it: never served
        assert err.value.errno in (errno.EIO, errno.ENOENT)
        assert int(os.getxattr(mount.path, "user.kvfs.checksum_failures")) >= 1
    finally:
        mount.stop()


def test_refuses_a_missing_mountpoint(tmp_path: Path) -> None:
    mnt = tmp_path / "nope"
    assert_refused(
        kvfs("mount", str(mnt), "--backing", str(tmp_path / "b"), check=False),
        "does not exist",
        mnt,
    )


def test_refuses_a_non_empty_mountpoint(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    (mount.path / "something").write_text("x")
    assert_refused(
        kvfs("mount", str(mount.path), "--backing", str(mount.backing), check=False),
        "not empty",
        mount.path,
    )


def test_refuses_an_already_mounted_mountpoint_and_a_busy_backing_dir(
    kv_mount: Mount, tmp_path: Path
) -> None:
    result = kvfs("mount", str(kv_mount.path), "--backing", str(tmp_path), check=False)
    assert result.returncode == 2 and "already mounted" in result.stderr
    other = tmp_path / "other"
    other.mkdir()
    result = kvfs("mount", str(other), "--backing", str(kv_mount.backing), check=False)
    assert_refused(result, "served by another kvfs daemon", other)
    assert (kv_mount.path / "still-serving").write_bytes(b"ok") == 2


def test_refuses_an_unwritable_backing_dir(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount.backing)], check=True
    )
    try:
        result = kvfs("mount", str(mount.path), "--backing", str(mount.backing), check=False)
        assert_refused(result, "not writable", mount.path)
    finally:
        subprocess.run(["umount", str(mount.backing)], check=True)


def test_refuses_backing_inside_the_mountpoint(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    result = kvfs("mount", str(mount.path), "--backing", str(mount.path / "b"), check=False)
    assert_refused(result, "must not contain", mount.path)


def _in_private_mount_namespace(
    hide: str, tmp_path: Path, mnt: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """Run `kvfs mount` (with ``options``) where ``hide`` is replaced by an empty regular file."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    script = (
        f"mount --bind {empty} {hide} && exec {sys.executable} -m kvfs.cli mount {mnt} "
        f"--backing {tmp_path / 'backing'} {' '.join(options)}"
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_refuses_without_dev_fuse(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    assert_refused(
        _in_private_mount_namespace("/dev/fuse", tmp_path, mount.path), "no /dev/fuse", mount.path
    )


def test_refuses_without_libfuse(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    name = ctypes.util.find_library("fuse3")
    assert name, "libfuse3 must be installed for this test"
    libs = [
        Path(d) / name
        for d in (
            "/lib/x86_64-linux-gnu",
            "/usr/lib/x86_64-linux-gnu",
            "/lib/aarch64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
        )
    ]
    lib = next((p.resolve() for p in libs if p.exists()), None)
    if lib is None:
        pytest.skip(f"cannot find the file behind {name}")
    assert_refused(
        _in_private_mount_namespace(str(lib), tmp_path, mount.path),
        "libfuse3 is missing",
        mount.path,
    )


def test_umount_of_something_else_is_refused(tmp_path: Path) -> None:
    result = kvfs("umount", str(tmp_path), check=False)
    assert result.returncode == 2 and "is not a kvfs mount" in result.stderr


@pytest.mark.parametrize("option", ["--metrics-port", "--events"])
def test_refuses_a_busy_port_before_it_says_mounted(tmp_path: Path, option: str) -> None:
    """Issue 14, item 1: the port is bound before the mount answers, so a busy one fails the
    `kvfs mount` command with one line, and leaves nothing mounted."""
    mount = make_mount(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        value = str(port) if option == "--metrics-port" else f"tcp://127.0.0.1:{port}"
        result = kvfs(
            "mount", str(mount.path), "--backing", str(mount.backing), option, value, check=False
        )
    assert result.returncode == 2 and "mounted" not in result.stdout
    assert "Address already in use" in result.stderr and option in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not mountctl.mount_stack(str(mount.path))


def test_every_help_states_its_defaults_and_every_argument_is_explained() -> None:
    """Issue 14: `kvfs --help` and every subcommand's help state defaults and units."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)  # positionals included
            valued = action.nargs != 0 and action.default not in (None, False)
            if valued and action.option_strings:
                assert "default" in action.help, (name, action.dest, action.help)


@pytest.mark.parametrize(
    "command", ["mount", "umount", "verify", "ls", "du", "stat", "top", "evict"]
)
def test_the_cli_pages_show_the_current_help(command: str) -> None:
    """docs/cli is generated (`python -m tools.cli_docs`): a help that changed without it fails
    here, so the pages never drift from what the commands say."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # the generator's width
    shown = subprocess.run(
        [sys.executable, "-m", "kvfs.cli", command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.rstrip()
    page = (Path(__file__).parent.parent / "docs" / "cli" / f"{command}.md").read_text()
    assert f"```text\n{shown}\n```" in page, "regenerate docs/cli: python -m tools.cli_docs"
