"""POSIX behaviour that engines and tools rely on, on a real mount."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import Mount

libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100


def renameat2(old: Path, new: Path, flags: int) -> None:
    if libc.renameat2(AT_FDCWD, bytes(old), AT_FDCWD, bytes(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.fixture
def d(kv_mount: Mount, request: pytest.FixtureRequest) -> Path:
    """A directory of the test's own on the module's mount."""
    path = kv_mount.path / request.node.name
    path.mkdir()
    return path


def test_create_write_read_and_backing_mirrors_the_tree(kv_mount: Mount, d: Path) -> None:
    (d / "sub").mkdir()
    (d / "sub" / "f").write_bytes(b"x" * 10000)
    assert (d / "sub" / "f").read_bytes() == b"x" * 10000
    backing = kv_mount.on_backing(d / "sub" / "f")
    assert backing.read_bytes() == b"x" * 10000
    assert os.getxattr(backing, "user.kvfs.checksum") == os.getxattr(
        d / "sub" / "f", "user.kvfs.checksum"
    )


def test_o_excl_create_of_an_existing_name_fails(d: Path) -> None:
    (d / "f").write_bytes(b"1")
    with pytest.raises(FileExistsError):
        os.open(d / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert (d / "f").read_bytes() == b"1"


def test_rename_replaces_atomically_and_readers_keep_the_old_bytes(d: Path) -> None:
    (d / "final").write_bytes(b"old" * 1000)
    with open(d / "final", "rb") as reader:
        (d / "tmp").write_bytes(b"new" * 1000)
        os.rename(d / "tmp", d / "final")
        assert (d / "final").read_bytes() == b"new" * 1000
        assert reader.read() == b"old" * 1000
    assert sorted(os.listdir(d)) == ["final"]


def assert_old_bytes_through(resolved: int, final: Path) -> None:
    """An open through ``resolved`` (an O_PATH fd of the replaced file) reads its old bytes,
    and still does once the file now named ``final`` is unlinked too."""
    for _ in range(2):
        with open(f"/proc/self/fd/{resolved}", "rb") as late:
            assert late.read() == b"old" * 1000
        final.unlink(missing_ok=True)


def test_a_file_renamed_over_before_its_publish_still_opens_through_an_earlier_lookup(
    kv_mount: Mount, d: Path
) -> None:
    """The same race with the replaced file not published yet when the rename comes (its
    last close, and so its publish, comes after the rename: a release is asynchronous): its
    bytes must outlive the rename for whoever resolved it before, as a published file's do,
    and go, uncharged, once the kernel forgets the file."""
    usage = kv_mount.path / ".kvfs" / "usage.json"
    before = json.loads(usage.read_bytes())
    fd = os.open(d / "final", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"old" * 1000)
    held = os.dup(fd)  # the same open file: no release, so no publish, until both close
    os.close(fd)
    resolved = os.open(d / "final", os.O_PATH)
    try:
        (d / "tmp").write_bytes(b"new" * 1000)
        os.rename(d / "tmp", d / "final")
        os.close(held)  # its publish finds its name taken by the rename
        kv_mount.settle()
        assert (d / "final").read_bytes() == b"new" * 1000
        assert_old_bytes_through(resolved, d / "final")
    finally:
        os.close(resolved)
    assert os.listdir(d) == []
    after = json.loads(usage.read_bytes())
    assert (after["used"], after["reserved"]) == (before["used"], 0)
    unlinked = kv_mount.backing / ".kvfs" / "unlinked"
    deadline = time.monotonic() + 10
    while os.listdir(unlinked):  # the kernel forgets the inode once nothing holds it
        assert time.monotonic() < deadline, os.listdir(unlinked)
        time.sleep(0.05)


def test_open_through_an_earlier_lookup_of_a_replaced_file_gets_the_old_bytes(
    kv_mount: Mount, d: Path
) -> None:
    """A reader resolved the name just before a writer renamed a new chunk over it (the race of
    concurrent vLLM instances): its open must still succeed, with the bytes it resolved."""
    (d / "final").write_bytes(b"old" * 1000)
    resolved = os.open(d / "final", os.O_PATH)  # a lookup, no FUSE open
    try:
        (d / "tmp").write_bytes(b"new" * 1000)
        os.rename(d / "tmp", d / "final")
        assert_old_bytes_through(resolved, d / "final")
    finally:
        os.close(resolved)
    assert not (kv_mount.backing / d.name / "final").exists()


def test_rename_noreplace_refuses_an_existing_target(d: Path) -> None:
    (d / "a").write_bytes(b"a")
    (d / "b").write_bytes(b"b")
    with pytest.raises(FileExistsError):
        renameat2(d / "a", d / "b", RENAME_NOREPLACE)
    renameat2(d / "a", d / "c", RENAME_NOREPLACE)
    assert (d / "b").read_bytes() == b"b" and (d / "c").read_bytes() == b"a"
    with pytest.raises(OSError) as err:
        renameat2(d / "b", d / "c", RENAME_EXCHANGE)
    assert err.value.errno == errno.EINVAL


def test_rename_of_directories(kv_mount: Mount, d: Path) -> None:
    (d / "x" / "y").mkdir(parents=True)
    (d / "x" / "y" / "f").write_bytes(b"f")
    os.rename(d / "x", d / "z")
    assert (d / "z" / "y" / "f").read_bytes() == b"f"
    assert kv_mount.on_backing(d / "z" / "y" / "f").read_bytes() == b"f"
    (d / "full").mkdir()
    (d / "full" / "g").write_bytes(b"g")
    with pytest.raises(OSError) as err:
        os.rename(d / "z", d / "full")
    assert err.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as err:
        os.rename(d / "z", d / "z" / "y" / "inside")
    assert err.value.errno == errno.EINVAL


def test_unlink_while_open_keeps_the_reader_and_frees_the_name(kv_mount: Mount, d: Path) -> None:
    (d / "f").write_bytes(b"data" * 4096)
    with open(d / "f", "rb") as reader:
        os.unlink(d / "f")
        assert not (d / "f").exists()
        assert not (kv_mount.backing / d.name / "f").exists()
        assert reader.read() == b"data" * 4096
    # Room held for it is given back once (it was given back twice when it was never published)
    kv_mount.settle()
    usage = kv_mount.usage()
    assert usage["reserved"] == 0


def test_a_file_unlinked_before_its_publish_leaves_the_accounting_exact(
    kv_mount: Mount, d: Path
) -> None:
    before = kv_mount.usage()
    with open(d / "f", "wb") as writer:
        writer.write(b"x" * 40960)
        os.unlink(d / "f")  # its close reserves room, its release finds no name to publish
    kv_mount.settle()
    after = kv_mount.usage()
    assert (after["used"], after["reserved"]) == (before["used"], 0)
    assert not os.listdir(kv_mount.backing / ".kvfs" / "tmp")


def test_mkdir_rmdir_readdir(d: Path) -> None:
    names = {f"n{i}" for i in range(300)}
    for name in names:
        (d / name).mkdir()
    assert set(os.listdir(d)) == names
    with pytest.raises(FileExistsError):
        (d / "n1").mkdir()
    (d / "n1" / "f").write_bytes(b"")
    with pytest.raises(OSError) as err:
        (d / "n1").rmdir()
    assert err.value.errno == errno.ENOTEMPTY
    for name in names - {"n1"}:
        (d / name).rmdir()
    assert os.listdir(d) == ["n1"]


def test_a_directory_reaches_the_backing_store_with_the_first_thing_put_beneath_it(
    kv_mount: Mount, d: Path
) -> None:
    """A mkdir changes only the index (an engine's mkdir -p before each store costs no disk
    trip); the first file published, symlink or special file made beneath makes the missing
    directories, with the modes and owners they have by then."""
    deep = d / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (d / "a").chmod(0o701)
    os.chown(d / "a" / "b", 65534, 65534)
    os.utime(deep, ns=(10**18, 10**18))
    backing = kv_mount.backing / d.name
    kv_mount.settle()
    assert not backing.exists()
    assert stat.S_IMODE((d / "a").stat().st_mode) == 0o701 and deep.stat().st_mtime_ns == 10**18
    (deep / "gone").mkdir()
    (deep / "gone").rmdir()
    os.rename(deep, d / "a" / "b" / "moved")
    (d / "a" / "b" / "moved" / "f").write_bytes(b"f" * 5000)
    kv_mount.settle()
    assert (backing / "a" / "b" / "moved" / "f").read_bytes() == b"f" * 5000
    assert not (backing / "a" / "b" / "c").exists()
    assert not (backing / "a" / "b" / "moved" / "gone").exists()
    for inside in (d, d / "a", d / "a" / "b", d / "a" / "b" / "moved"):
        mounted, held = inside.stat(), (backing / inside.relative_to(d)).stat()
        assert (mounted.st_mode, mounted.st_uid, mounted.st_gid) == (
            held.st_mode,
            held.st_uid,
            held.st_gid,
        ), inside
    (d / "s").mkdir()
    os.symlink("target", d / "s" / "link")
    assert os.readlink(backing / "s" / "link") == "target"


def test_a_directory_renamed_over_an_empty_one_takes_its_place_on_the_backing_store(
    kv_mount: Mount, d: Path
) -> None:
    (d / "old").mkdir()
    (d / "old" / "f").write_bytes(b"1")
    kv_mount.settle()
    (d / "old" / "f").unlink()  # "old" is on the backing store, empty
    os.setxattr(d / "old", "user.kvfs.pin", b"1")
    assert os.getxattr(kv_mount.backing / d.name / "old", "user.kvfs.pinned") == b"1"
    (d / "new").mkdir(mode=0o711)  # only in the index
    assert (d / "new").stat().st_mode != (d / "old").stat().st_mode
    os.rename(d / "new", d / "old")
    (d / "old" / "g").write_bytes(b"g")
    held = kv_mount.on_backing(d / "old")
    assert os.listdir(held) == ["g"] and held.stat().st_mode == (d / "old").stat().st_mode
    assert not (kv_mount.backing / d.name / "new").exists()
    assert os.getxattr(d / "old", "user.kvfs.pin") == b"0"  # the one that took the name
    with pytest.raises(OSError):  # ... and its own directory on the backing store
        os.getxattr(held, "user.kvfs.pinned")


def test_directories_only_the_index_has_are_made_at_unmount_and_lost_only_to_a_kill(
    fresh_mount: Mount,
) -> None:
    root = fresh_mount.path
    (root / "kept" / "deep").mkdir(parents=True)
    os.chmod(root / "kept" / "deep", 0o705)
    fresh_mount.restart()
    for base in (root, fresh_mount.backing):
        assert stat.S_IMODE((base / "kept" / "deep").stat().st_mode) == 0o705
    (root / "lost" / "deep").mkdir(parents=True)
    (root / "stored" / "deep").mkdir(parents=True)
    (root / "stored" / "deep" / "f").write_bytes(b"f" * 4096)
    fresh_mount.settle()
    fresh_mount.kill()
    fresh_mount.start()
    assert (root / "stored" / "deep" / "f").read_bytes() == b"f" * 4096
    assert sorted(os.listdir(root)) == ["kept", "stored"]


def test_setattr_truncate_chmod_chown_utimens(kv_mount: Mount, d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"0123456789")
    os.truncate(f, 4)
    assert f.read_bytes() == b"0123"
    os.truncate(f, 6)
    assert f.read_bytes() == b"0123\0\0"
    with open(f, "r+b") as fh:
        fh.truncate(2)
        fh.seek(0, 2)
        fh.write(b"!")
    assert f.read_bytes() == b"01!"
    os.chmod(f, 0o600)
    os.chown(f, 1234, 5678)
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    for path in (f, kv_mount.on_backing(f)):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        assert st.st_mtime_ns == 2_000_000_000
    assert kv_mount.on_backing(f).read_bytes() == b"01!"


def test_overwrite_in_place_and_append(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"a" * 8192)
    with open(f, "r+b") as fh:
        fh.seek(4096)
        fh.write(b"b" * 10)
        fh.flush()
        os.fsync(fh.fileno())
    with open(f, "ab") as fh:
        fh.write(b"c")
    assert f.read_bytes() == b"a" * 4096 + b"b" * 10 + b"a" * 4086 + b"c"


def test_xattrs_other_than_kvfs_own_are_refused(d: Path) -> None:
    (d / "f").write_bytes(b"f")
    with pytest.raises(OSError) as err:
        os.setxattr(d / "f", "user.other", b"1")
    assert err.value.errno == errno.ENOTSUP
    assert sorted(os.listdir(d)) == ["f"]


def test_names_longer_than_name_max(d: Path) -> None:
    with pytest.raises(OSError) as err:
        (d / ("x" * 256)).write_bytes(b"")
    assert err.value.errno == errno.ENAMETOOLONG
    (d / ("x" * 255)).write_bytes(b"ok")
    assert (d / ("x" * 255)).read_bytes() == b"ok"


def test_the_backing_private_area_is_hidden_and_the_control_dir_is_read_only(
    kv_mount: Mount,
) -> None:
    assert ".kvfs" not in os.listdir(kv_mount.path)  # neither shown nor counted by du
    control = kv_mount.path / ".kvfs"
    assert sorted(os.listdir(control)) == ["lookup", "namespaces.json", "usage.json"]
    assert not (control / "tmp").exists()  # the backing directory's .kvfs stays private
    with pytest.raises(OSError) as err:
        (control / "new").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    with pytest.raises(FileExistsError):
        control.mkdir()


def test_access_stat_of_missing_names(d: Path) -> None:
    for _ in range(3):  # the second and third come from the kernel's negative entries
        assert not os.access(d / "missing", os.F_OK)
    (d / "missing").write_bytes(b"now here")
    assert os.access(d / "missing", os.F_OK)


def test_du_and_df_tell_the_truth(kv_mount: Mount, d: Path) -> None:
    (d / "a").write_bytes(os.urandom(1 << 20))
    (d / "b").write_bytes(os.urandom(12288))
    du = subprocess.run(["du", "-sb", str(d)], capture_output=True, text=True, check=True)
    assert int(du.stdout.split()[0]) == (1 << 20) + 12288
    blocks = sum(os.stat(kv_mount.on_backing(d / n)).st_blocks for n in "ab")
    assert sum(os.stat(d / n).st_blocks for n in "ab") == blocks
    kv_mount.settle()
    mine, backing = os.statvfs(kv_mount.path), os.statvfs(kv_mount.backing)
    capacity = int(os.getxattr(kv_mount.path, "user.kvfs.capacity"))
    used = int(os.getxattr(kv_mount.path, "user.kvfs.used"))
    assert capacity <= int(backing.f_blocks * backing.f_frsize * 0.9)  # the default: 90 %
    assert mine.f_blocks * mine.f_frsize == capacity // 4096 * 4096
    assert mine.f_bavail * mine.f_frsize <= min(capacity - used, backing.f_bavail * 4096)
    assert mine.f_namemax == 255


def test_fsync_of_a_published_file(d: Path) -> None:
    (d / "f").write_bytes(b"durable")
    fd = os.open(d / "f", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
