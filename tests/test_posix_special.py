"""Symlinks, hard links, fifos, sockets and device nodes behave inside the mount as on ext4,
and permissions hold for other users; none of them is a chunk."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NOBODY, Mount, as_nobody, kvfs, make_mount
from tools import vllm_io

# Run once in a plain ext4 directory and once in the mount: the outputs must be the same.
# (Device nodes are created, never opened: a FUSE mount is nodev, as it should be.)
SCRIPT = r"""
exec 2>&1; umask 027
echo hello > f
ln -s f sym; ln -s missing dangling; ln -s loop1 loop2; ln -s loop2 loop1
ln f hard
mkfifo fifo
mknod null c 1 3 && stat -c '%n %t:%T' null
python3 -c "import socket; socket.socket(socket.AF_UNIX).bind('sock')"
mkdir -p sub/deep; ln -s ../f sub/up; chmod 2775 sub; mkdir sub/inherits
for n in f sym dangling hard fifo sock sub sub/up sub/deep sub/inherits; do
  stat -c '%n %F links=%h mode=%a' "$n"
done
stat -c '%n %s' f sym dangling sub/up
readlink sym sub/up loop1
cat sym sub/up hard
cat loop1; cat dangling
test -L sym && test -p fifo && test -S sock && test -c null && echo types ok
echo more >> hard; cat f; stat -c 'links=%h' f
rm hard; stat -c 'links=%h' f; cat f
ln sub subhard; ln missing other
mv sym renamed; readlink renamed; cat renamed
ln -sf f renamed; readlink renamed
(echo through the fifo > fifo &); cat fifo
touch -h -d @1000000000 renamed; stat -c '%n %Y' renamed
cp -a sub copy; find copy sub | sort | while read p; do stat -c '%n %F %a' "$p"; done
find . -type l | sort; find . -type p; find . -type s; find . -links 2 -type d | sort
tar cf ../listing.tar --sort=name --exclude=./fifo --exclude=./sock --exclude=./null . \
  && tar tvf ../listing.tar | awk '{print $1, $NF}'
rm -r copy sub loop1 loop2 renamed fifo sock dangling null f other 2>/dev/null; ls -A
"""


def run_script(where: Path) -> str:
    done = subprocess.run(
        ["bash", "-c", SCRIPT], cwd=where, capture_output=True, text=True, timeout=60
    )
    return done.stdout


def test_posix_tools_behave_in_the_mount_as_on_ext4(fresh_mount: Mount, tmp_path: Path) -> None:
    plain = tmp_path / "ext4" / "work"
    plain.mkdir(parents=True)
    inside = fresh_mount.path / "work"
    inside.mkdir()
    for work in (plain, inside):
        work.chmod(0o750)
    expected, got = run_script(plain), run_script(inside)
    assert "types ok" in expected and "Too many levels of symbolic links" in expected
    assert got == expected


def test_links_and_special_files_survive_a_restart_and_are_never_chunks(
    fresh_mount: Mount,
) -> None:
    root = fresh_mount.path
    vllm_io.store(str(root / "chunk"), b"c" * 8192)
    os.symlink("chunk", root / "sym")
    os.link(root / "chunk", root / "hard")
    os.mkfifo(root / "fifo", 0o640)
    os.mknod(root / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    fresh_mount.settle()
    for _ in range(2):  # served, then rebuilt from the backing directory by a restart
        assert os.readlink(root / "sym") == "chunk"
        assert os.stat(root / "chunk").st_nlink == 2
        assert os.stat(root / "hard").st_ino == os.stat(root / "chunk").st_ino
        assert stat.S_ISFIFO(os.stat(root / "fifo").st_mode)
        assert os.stat(root / "null").st_rdev == os.makedev(1, 3)
        assert (root / "hard").read_bytes() == b"c" * 8192
        for name in ("sym", "fifo", "null"):  # nothing to checksum, nothing to count
            assert "user.kvfs.checksum" not in os.listxattr(root / name, follow_symlinks=False)
        usage = json.loads((root / ".kvfs" / "usage.json").read_bytes())
        assert usage["files"] == 1 and usage["bytes"] == 8192
        fresh_mount.restart()
    # A publish through one name reaches every name; and verify never opens a fifo.
    vllm_io.store(str(root / "new"), b"n" * 4096)
    os.replace(root / "new", root / "hard")  # rename over one name: the other keeps the old
    assert (root / "chunk").read_bytes() == b"c" * 8192
    with open(root / "chunk", "r+b") as f:
        f.write(b"w" * 4096)
    os.link(root / "chunk", root / "again")
    fresh_mount.settle()
    expected = b"w" * 4096 + b"c" * 4096
    assert (fresh_mount.backing / "again").read_bytes() == expected
    report = json.loads(kvfs("verify", "--json", str(root)).stdout)
    assert report["files"] == 3 and report["bad"] == []


@pytest.fixture
def shared_mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount other users may enter (-o allow_other); the kernel checks permissions."""
    mount = make_mount(tmp_path, "-o", "allow_other", "--umask", "0")
    tmp_path.chmod(0o755)
    try:
        yield mount.start()
    finally:
        mount.stop()


def errno_of(code: str, cwd: Path) -> str:
    """Run ``code`` as nobody; the errno name it failed with, or "ok"."""
    wrapped = (
        "import errno, os\n"
        f"try:\n    {code}\n    print('ok')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
    )
    done = as_nobody("python3", "-c", wrapped, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_permissions_and_ownership_hold_for_other_users(shared_mount: Mount) -> None:
    root = shared_mount.path
    os.chmod(root, 0o755)
    (root / "private").write_bytes(b"secret")
    os.chmod(root / "private", 0o600)
    (root / "public").mkdir(mode=0o1777)
    os.chmod(root / "public", 0o1777)  # sticky, like /tmp
    (root / "public" / "roots").write_bytes(b"r")
    (root / "group").mkdir()
    os.chown(root / "group", 0, 4321)
    os.chmod(root / "group", 0o2777)

    assert errno_of("open('private').read()", root) == "EACCES"
    assert errno_of("open('new', 'w')", root) == "EACCES"  # root's 0755 directory
    assert errno_of("os.chmod('private', 0o644)", root) == "EPERM"
    assert errno_of("os.chown('public/roots', 65534, 65534)", root) == "EPERM"
    assert errno_of("os.unlink('public/roots')", root) in ("EPERM", "EACCES")  # sticky
    assert errno_of("open('public/mine', 'w').write('m')", root) == "ok"
    assert errno_of("os.symlink('mine', 'public/link')", root) == "ok"
    assert errno_of("os.mkdir('group/sub')", root) == "ok"
    assert errno_of("open('group/file', 'w').write('g')", root) == "ok"
    # (a directory reaches the backing store with the first file in it)
    assert errno_of("open('group/sub/file', 'w').write('s')", root) == "ok"
    shared_mount.settle()
    for path in (root / "public" / "mine", shared_mount.backing / "public" / "mine"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    for name in ("sub", "file"):  # a set-group-ID directory hands its group down
        for base in (root, shared_mount.backing):
            assert os.lstat(base / "group" / name).st_gid == 4321
    for base in (root, shared_mount.backing):
        assert os.stat(base / "group" / "sub").st_mode & stat.S_ISGID
    assert os.lstat(root / "public" / "link").st_uid == NOBODY
    assert errno_of("os.unlink('public/mine')", root) == "ok"
    os.chown(root / "public" / "roots", NOBODY, NOBODY)  # and root may do what root may
    os.unlink(root / "public" / "roots")
    assert sorted(os.listdir(root / "public")) == ["link"]
