"""The shared host region: one mapping for every worker, removed by its last user, crash or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.host_region import HEADER_BYTES, HostRegion, RegionError, region_path, sweep_orphans
from tests.conftest import mappings

SLOT = 8192
PRINT = "fingerprint-a"


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    path = region_path(name)
    if path.exists():
        path.unlink()
        pytest.fail("the test left its host region behind")


def worker(name: str, action: str = "") -> subprocess.Popen[str]:
    """A process that attaches, writes its pid into slot 1, says 'up', then waits for stdin."""
    code = textwrap.dedent(f"""
        import os, sys
        from kvfs.host_region import HostRegion
        region = HostRegion.attach({name!r}, {PRINT!r})
        region.slot(1)[:8] = os.getpid().to_bytes(8, "little")
        print("up", flush=True)
        sys.stdin.readline()
        {action}
        region.close()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0


def test_workers_share_one_mapping(name: str) -> None:
    with HostRegion.create(name, 4, SLOT, PRINT) as region:
        assert region.view.shape == (4, SLOT) and region.view.strides == (SLOT, 1)
        assert os.stat(region.path).st_size == HEADER_BYTES + 4 * SLOT
        proc = worker(name)
        assert int.from_bytes(region.slot(1)[:8], "little") == proc.pid
        finish(proc)
        assert region.path.exists(), "a worker closing is not the last user"
    assert not region_path(name).exists()


def _resident_kib(path: Path) -> list[int]:
    """Resident KiB of each of this process's mappings of the file at ``path``."""
    return [
        int(next(line for line in lines if line.startswith("Rss:")).split()[1])
        for lines in mappings(path)
    ]


def test_the_region_is_resident_from_the_start(name: str) -> None:
    """Creator and workers map the region populated: no copy into it faults a page in (on a
    VM whose freed memory went back to the host, a first touch cost ~30 us a page)."""
    size_kib = (HEADER_BYTES + 512 * SLOT) // 1024  # 4 MiB of slots
    with HostRegion.create(name, 512, SLOT, PRINT) as region:
        assert _resident_kib(region.path) == [size_kib]
        with HostRegion.attach(name, PRINT):
            assert _resident_kib(region.path) == [size_kib, size_kib]


def test_a_crashed_worker_does_not_keep_the_region(name: str) -> None:
    region = HostRegion.create(name, 2, SLOT, PRINT)
    crashed, survivor = worker(name), worker(name)
    crashed.send_signal(signal.SIGKILL)
    crashed.wait(timeout=30)
    region.close()  # the creator leaves before the survivor: the survivor is the last user
    assert region.path.exists()
    finish(survivor)
    assert not region.path.exists()


def test_regions_whose_processes_all_died_are_swept(name: str) -> None:
    creator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from kvfs.host_region import HostRegion; import sys; "
            f"HostRegion.create({name!r}, 2, {SLOT}, {PRINT!r}); print('up', flush=True); "
            f"sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert creator.stdout is not None and creator.stdout.readline().strip() == "up"
    attached = worker(name)
    for proc in (creator, attached):
        proc.kill()
        proc.wait(timeout=30)
    assert region_path(name).exists()
    other = f"{name}-new"
    with HostRegion.create(other, 1, SLOT, PRINT):  # a new instance starting sweeps it
        assert not region_path(name).exists()
    assert not region_path(other).exists()


def test_live_regions_are_not_swept(name: str) -> None:
    with HostRegion.create(name, 1, SLOT, PRINT) as region:
        assert region.path not in sweep_orphans()
        assert region.path.exists()


def test_bad_regions_are_refused_and_leave_nothing(name: str) -> None:
    with HostRegion.create(name, 1, SLOT, PRINT):
        with pytest.raises(RegionError, match="another instance uses the name"):
            HostRegion.create(name, 1, SLOT, PRINT)
        with pytest.raises(RegionError, match="another chunk layout"):
            HostRegion.attach(name, "fingerprint-b")
    with pytest.raises(RegionError, match="no host region"):
        HostRegion.attach(name, PRINT, timeout=0.1)
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(RegionError, match="bytes free"):
        HostRegion.create(name, free // SLOT + 16, SLOT, PRINT)
    with pytest.raises(RegionError, match="multiple of 4096"):
        HostRegion.create(name, 1, 1000, PRINT)
    with pytest.raises(RegionError, match="region name"):
        HostRegion.create("../etc", 1, SLOT, PRINT)
    assert not list(Path("/dev/shm").glob(f"*{name}*"))


def test_attach_waits_for_the_creator(name: str) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kvfs.host_region import HostRegion; "
            f"r = HostRegion.attach({name!r}, {PRINT!r}, timeout=30); "
            "print(r.num_slots); r.close()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    with HostRegion.create(name, 3, SLOT, PRINT):
        out, _ = proc.communicate(timeout=30)
    assert out.strip() == "3"


def test_a_closed_region_still_referenced_does_not_hold_it(name: str) -> None:
    creator = HostRegion.create(name, 1, SLOT, PRINT)
    attached = HostRegion.attach(name, PRINT)
    kept = attached.slot(0)  # a tensor over the region keeps its mapping alive like this
    attached.close()
    creator.close()
    assert not region_path(name).exists(), "the closed-but-mapped attachment held its lock"
    kept.release()
