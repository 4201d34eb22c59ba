"""What kvfs exposes, and to whom: host regions in /dev/shm, sockets, mount options, logs, modes."""

from __future__ import annotations

import ipaddress
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs import mountctl
from kvfs.config import ConfigError, MountConfig, daemon_log, parse_umask
from kvfs.host_region import _HEADER, _MAGIC, HEADER_BYTES, HostRegion, RegionError, region_path
from tests.conftest import NOBODY, Mount, as_nobody, free_port, kvfs, make_mount

SLOT = 8192
PRINT = "fingerprint-a"
ROOT = Path(__file__).resolve().parent.parent

# -- D11: the host region never follows, truncates or adopts a file it did not create ----------


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for leftover in Path("/dev/shm").glob(f"*{name}*"):
        leftover.unlink()


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file an attacker would like kvfs to overwrite (on /dev/shm, so it can be hard linked)."""
    path = Path("/dev/shm") / f"victim-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"precious data\n" * 100)
    os.close(fd)
    yield path
    path.unlink(missing_ok=True)


def snapshot(path: Path) -> tuple[bytes, int, int]:
    st = os.stat(path)
    return path.read_bytes(), st.st_mode, st.st_mtime_ns


def region_header(slots: int = 1) -> bytes:
    return _HEADER.pack(_MAGIC, SLOT, slots, PRINT.encode())


def plant_region(path: Path, mode: int = 0o600, size: int = HEADER_BYTES + SLOT) -> None:
    """A file that looks like a region: right header, given mode and size."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, size)
    os.pwrite(fd, region_header(), 0)
    os.fchmod(fd, mode)
    os.close(fd)


def test_a_symlink_at_the_private_build_name_is_never_followed(name: str, victim: Path) -> None:
    before = snapshot(victim)
    final = region_path(name)
    planted = final.parent / f".{final.name}.{os.getpid()}"  # the name creation used to take
    planted.symlink_to(victim)
    try:
        with HostRegion.create(name, 2, SLOT, PRINT) as region:
            region.slot(0)[:4] = b"mine"
    finally:
        planted.unlink()
    assert snapshot(victim) == before


def test_a_symlink_at_the_region_name_is_refused(name: str, victim: Path) -> None:
    before = snapshot(victim)
    region_path(name).symlink_to(victim)
    with pytest.raises(RegionError, match="symbolic link"):
        HostRegion.create(name, 1, SLOT, PRINT)
    started = time.monotonic()
    with pytest.raises(RegionError, match="symbolic link"):
        HostRegion.attach(name, PRINT, timeout=10)
    assert time.monotonic() - started < 2, "refused at once, not after the timeout"
    assert snapshot(victim) == before
    assert region_path(name).is_symlink(), "the sweep removes only regions it made"


def test_a_hard_link_at_the_region_name_is_refused(name: str) -> None:
    looks_right = Path("/dev/shm") / f"victim-{uuid.uuid4().hex[:12]}"  # ours, 0600, a header
    plant_region(looks_right)
    try:
        os.link(looks_right, region_path(name))
        before = snapshot(looks_right)
        with pytest.raises(RegionError, match="hard link"):
            HostRegion.create(name, 1, SLOT, PRINT)
        with pytest.raises(RegionError, match="hard link"):
            HostRegion.attach(name, PRINT, timeout=10)
        assert snapshot(looks_right) == before
    finally:
        looks_right.unlink()


def test_a_region_of_another_user_is_refused(name: str) -> None:
    path = region_path(name)
    plant_region(path)
    os.chown(path, NOBODY, NOBODY)
    before = snapshot(path)
    with pytest.raises(RegionError, match=f"owned by uid {NOBODY}"):
        HostRegion.attach(name, PRINT, timeout=10)
    with pytest.raises(RegionError, match=f"owned by uid {NOBODY}"):
        HostRegion.create(name, 1, SLOT, PRINT)
    assert snapshot(path) == before and os.stat(path).st_uid == NOBODY


def test_a_region_others_may_write_is_refused(name: str) -> None:
    plant_region(region_path(name), mode=0o666)
    with pytest.raises(RegionError, match="mode 0666"):
        HostRegion.attach(name, PRINT, timeout=10)


def test_a_fifo_or_a_short_file_at_the_region_name_is_refused(name: str) -> None:
    path = region_path(name)
    os.mkfifo(path, 0o600)
    with pytest.raises(RegionError, match="not a regular file"):
        HostRegion.attach(name, PRINT, timeout=10)  # and does not block opening a FIFO
    path.unlink()
    plant_region(path, size=HEADER_BYTES)  # the header promises one slot the file lacks
    with pytest.raises(RegionError, match="shorter than its header says"):
        HostRegion.attach(name, PRINT, timeout=10)


def test_regions_are_private_to_their_user(name: str) -> None:
    with HostRegion.create(name, 1, SLOT, PRINT) as region:
        st = os.lstat(region.path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid() and st.st_nlink == 1
        with HostRegion.attach(name, PRINT) as other:
            other.slot(0)[:2] = b"ok"
        assert bytes(region.slot(0)[:2]) == b"ok"
    assert not list(Path("/dev/shm").glob(f"*{name}*"))


# -- D12 (a): /metrics listens on loopback unless told otherwise -------------------------------


def listeners(port: int, timeout: float = 5.0) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` (waits for the first to appear)."""
    deadline = time.monotonic() + timeout
    while True:
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    address, hex_port = local.split(":")
                    if state == "0A" and int(hex_port, 16) == port:
                        raw = bytes.fromhex(address)
                        words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                        found.add(str(ipaddress.ip_address(words)))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def stop_after() -> Iterator[list[Mount]]:
    mounts: list[Mount] = []
    yield mounts
    for mount in mounts:
        mount.stop()


def test_mount_metrics_listen_on_loopback_by_default(
    tmp_path: Path, stop_after: list[Mount]
) -> None:
    port = free_port()
    stop_after.append(make_mount(tmp_path, "--metrics-port", str(port)).start())
    assert listeners(port) == {"127.0.0.1"}


def test_mount_metrics_address_is_an_explicit_choice(
    tmp_path: Path, stop_after: list[Mount]
) -> None:
    port = free_port()
    options = ("--metrics-port", str(port), "--metrics-address", "0.0.0.0")
    stop_after.append(make_mount(tmp_path, *options).start())
    assert listeners(port) == {"0.0.0.0"}
    refused = kvfs("mount", str(tmp_path), "--metrics-address", "every interface", check=False)
    assert refused.returncode == 2 and "metrics address" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_connector_metrics_listen_on_loopback_unless_configured() -> None:
    from kvfs.connector.config import ConnectorConfig
    from kvfs.connector.kv_connector import KVConnector
    from tests import kv_model

    geo = kv_model.geometry(2)
    kv = kv_model.shard(geo, kv_model.full_tensors(geo), 1, 0, "NHD")
    for extra, expected in (({}, "127.0.0.1"), ({"metrics_address": "0.0.0.0"}, "0.0.0.0")):
        port = free_port()
        config = {"cpu_bytes_to_use": 16 << 20, "blocks_per_chunk": 2, "metrics_port": port}
        conn = KVConnector({**config, **extra}, geo, kv, "m", f"sec-{uuid.uuid4().hex[:8]}", 4)
        try:
            assert listeners(port) == {expected}
        finally:
            conn.close()
    with pytest.raises(ConfigError, match="metrics_address"):
        ConnectorConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20, "metrics_address": 5})


# -- D12 (b): the docs never suggest publishing to every interface ------------------------------


def test_docs_never_suggest_binding_every_interface() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for bad in ("tcp://0.0.0.0", "tcp://*", "tcp://[::]"):
                assert bad not in line, f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert "--events tcp://127.0.0.1:" in guide


# -- D12 (c): allow_other only when asked; the -o list is checked -------------------------------


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's own are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="kvfs-sec-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def fuse_super_options(mnt: Path) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[4] == str(mnt) and fields[sep + 1] == "fuse.kvfs":
                return set(fields[sep + 3].split(","))
    raise AssertionError(f"no kvfs mount at {mnt}")


def test_other_users_cannot_reach_the_mount_by_default(
    public_dir: Path, stop_after: list[Mount]
) -> None:
    mount = make_mount(public_dir)
    mount.path.chmod(0o755)
    stop_after.append(mount.start())
    assert not {"allow_other", "default_permissions"} & fuse_super_options(mount.path)
    denied = as_nobody("ls", str(mount.path))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def test_allow_other_when_asked(public_dir: Path, stop_after: list[Mount]) -> None:
    mount = make_mount(public_dir, "-o", "allow_other", "-o", "default_permissions,nosuid")
    mount.path.chmod(0o755)
    stop_after.append(mount.start())
    assert {"allow_other", "default_permissions"} <= fuse_super_options(mount.path)
    assert as_nobody("ls", str(mount.path)).returncode == 0


def test_allow_other_brings_the_kernels_mode_checks(
    public_dir: Path, stop_after: list[Mount]
) -> None:
    """Without allow_other only root reaches a root mount and kvfs leaves the mode bits out
    (they do not restrict root); with it, other users meet them."""
    mount = make_mount(public_dir, "-o", "allow_other")
    mount.path.chmod(0o755)
    stop_after.append(mount.start())
    assert "default_permissions" in fuse_super_options(mount.path)
    private = mount.path / "private"
    private.write_bytes(b"model state")
    private.chmod(0o600)
    denied = as_nobody("cat", str(private))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert as_nobody("ls", str(mount.path)).returncode == 0


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ("bogus", "-o bogus: not accepted (accepted: allow_other, allow_root"),
        ("auto_unmount", "-o auto_unmount: not accepted"),
        ("fsname=evil", "-o fsname=evil: not accepted"),
        ("allow_other,,", "-o '': not accepted"),
    ],
)
def test_unknown_mount_options_are_refused(tmp_path: Path, option: str, words: str) -> None:
    mount = make_mount(tmp_path)
    result = kvfs(
        "mount", str(mount.path), "--backing", str(mount.backing), "-o", option, check=False
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0], lines
    assert mountctl.mount_stack(str(mount.path)) == []


# -- D12 (d): the daemon log is not world-readable ----------------------------------------------


def test_daemon_log_is_0640_in_a_0750_directory(tmp_path: Path, stop_after: list[Mount]) -> None:
    mount = make_mount(tmp_path)
    log = daemon_log(mount.path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.parent.chmod(0o755)  # as an older kvfs left them
    log.write_text("an older run\n")
    log.chmod(0o644)
    stop_after.append(mount.start())
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(log.parent).st_mode) == 0o750
    assert log.read_text().startswith("an older run\n")  # appended to, not replaced


def test_daemon_log_is_never_a_symlink_target(tmp_path: Path) -> None:
    mount = make_mount(tmp_path)
    log = daemon_log(mount.path)
    log.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    log.unlink(missing_ok=True)
    log.symlink_to(target)
    try:
        result = kvfs("mount", str(mount.path), "--backing", str(mount.backing), check=False)
        assert result.returncode == 2 and "symbolic link" in result.stderr
        assert target.read_text() == "precious\n"
        assert mountctl.mount_stack(str(mount.path)) == []
    finally:
        log.unlink()


# -- D12 (e): chunk files get the mount's umask, 027 unless told otherwise ----------------------


def test_umask_defaults_to_027_and_is_validated() -> None:
    assert MountConfig(Path("/m"), Path("/b")).file_umask == 0o027
    assert parse_umask("077") == 0o077 == parse_umask("0o077") == parse_umask("0077")
    for bad in ("", "8", "0x1f", "1000", "-1", "rwx"):
        with pytest.raises(ConfigError, match="--umask"):
            parse_umask(bad)
    with pytest.raises(ConfigError, match="file_umask"):
        MountConfig(Path("/m"), Path("/b"), file_umask=0o1000)


def test_umask_reaches_the_daemon(tmp_path: Path, stop_after: list[Mount]) -> None:
    from kvfs.mount.daemon import parse_config

    cfg = parse_config([str(tmp_path), "--backing", str(tmp_path), "--umask", "077"])
    assert cfg.file_umask == 0o077
    assert parse_config([str(tmp_path), "--backing", str(tmp_path)]).file_umask == 0o027
    mount = make_mount(tmp_path, "--umask", "077")
    stop_after.append(mount.start())
    with open(f"/proc/{mount.pid}/cmdline", "rb") as f:
        assert b"--umask=077" in f.read().split(b"\0")
    refused = kvfs("mount", str(tmp_path / "x"), "--umask", "9", check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "kvfs: --umask: '9' is not an octal umask (e.g. 027)"
