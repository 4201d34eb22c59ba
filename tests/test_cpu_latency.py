"""--cpu-latency: the daemon holds a CPU latency request exactly while it serves the mount,
and a mount that cannot hold the one asked for is refused."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvfs import cpu_latency, mountctl
from tests.conftest import kvfs, make_mount, wait_gone
from tests.test_cli import _in_private_mount_namespace, assert_refused
from tests.test_daemon_death import _wait_for_new_daemon, kill_daemon


@pytest.fixture
def unbound() -> int:
    """The machine's bound before the test, which a held request of 0 us must change."""
    was = cpu_latency.current()
    if was == 0:
        pytest.skip("something on this machine holds a 0 us request already")
    return was


def test_the_request_is_held_while_the_mount_serves_and_dropped_at_unmount(
    tmp_path: Path, unbound: int
) -> None:
    mount = make_mount(tmp_path, "--cpu-latency", "0")
    try:
        mount.start()
        assert cpu_latency.current() == 0
        (mount.path / "ns").mkdir()
        (mount.path / "ns" / "f").write_bytes(b"served")
        assert (mount.path / "ns" / "f").read_bytes() == b"served"
    finally:
        mount.stop()
    assert cpu_latency.current() == unbound


def test_a_killed_daemon_leaves_no_request_behind(tmp_path: Path, unbound: int) -> None:
    mount = make_mount(tmp_path, "--cpu-latency", "0")
    try:
        mount.start()
        assert cpu_latency.current() == 0
        mount.kill()
        assert cpu_latency.current() == unbound
    finally:
        mount.stop()


def test_a_supervised_daemon_holds_it_again_once_restarted(tmp_path: Path, unbound: int) -> None:
    """The supervisor restarts a killed daemon with the mount's options, the request's too;
    kvfs umount then ends both, and the request with them."""
    mount = make_mount(tmp_path, "--supervise", "--cpu-latency", "0")
    try:
        mount.start()
        [supervisor] = mountctl.supervisors(str(mount.path))
        old = mount.pid
        kill_daemon(mount)
        mount.pid = _wait_for_new_daemon(mount, old, timeout=10)
        assert cpu_latency.current() == 0
        kvfs("umount", str(mount.path))
        wait_gone(supervisor, timeout=10)
        assert cpu_latency.current() == unbound
    finally:
        mount.stop()
        for pid in mountctl.supervisors(str(mount.path)):
            os.kill(pid, signal.SIGKILL)


def test_a_mount_that_cannot_hold_its_request_is_refused(tmp_path: Path) -> None:
    """Where /dev/cpu_dma_latency is not the kernel's device (here an empty file in its
    place; for an unprivileged user, not writable): one line, nothing mounted."""
    mount = make_mount(tmp_path)
    refused = _in_private_mount_namespace(
        cpu_latency.DEVICE, tmp_path, mount.path, "--cpu-latency", "0"
    )
    assert_refused(refused, "--cpu-latency: /dev/cpu_dma_latency", mount.path)


@pytest.mark.parametrize("value", ["-1", "2000000001", "1.5", "0x10", "soon"])
def test_a_value_that_is_no_latency_is_refused(tmp_path: Path, value: str) -> None:
    mount = make_mount(tmp_path)
    for given in (("--cpu-latency", value), ("-o", f"cpu-latency={value}")):
        refused = kvfs(
            "mount", str(mount.path), "--backing", str(mount.backing), *given, check=False
        )
        assert_refused(refused, "cpu", mount.path)
