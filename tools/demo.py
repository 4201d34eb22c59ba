"""`make run`: mount kvfs, store and load a few chunks the way vLLM does, show the tier.

Leaves the mount up, with a hint on pointing vLLM at it and unmounting it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
from pathlib import Path

from kvfs import mountctl
from tools import vllm_io

CHUNK = 2 << 20  # Llama-3-8B, bf16, one 16-token block: 2 MiB per chunk
NAMESPACE = "demo_Llama-3-8B_5f1d2c3b4a69"


def sh(*command: str) -> None:
    print(f"$ {' '.join(command)}", flush=True)
    subprocess.run(command, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mountpoint", type=Path, nargs="?", default=Path("/mnt/kv-cache"))
    args = parser.parse_args()
    mnt = args.mountpoint.absolute()
    kvfs = [sys.executable, "-m", "kvfs.cli"]
    mounted = str(mnt) in mountctl.kvfs_mounts()
    if not mounted or mountctl.is_dead(str(mnt)):  # a dead mount is replaced in place
        if not mounted:
            mnt.mkdir(parents=True, exist_ok=True)
        if subprocess.run([*kvfs, "mount", str(mnt)]).returncode != 0:
            return 1
    else:
        print(f"kvfs: {mnt} is already mounted")

    namespace = mnt / NAMESPACE  # vLLM's config dir; the chunks go to <namespace>_r0
    namespace.mkdir(exist_ok=True)
    config = namespace / "config.json"
    if not config.exists():
        config.write_text(
            json.dumps(
                {
                    "model_name": "demo/Llama-3-8B",
                    "tokens_per_hash": 16,
                    "blocks_per_file": 1,
                    "dtype": "bfloat16",
                },
                indent=2,
            )
        )
    use_o_direct = vllm_io.probe_o_direct(str(namespace))
    root = str(mnt)
    buf = mmap.mmap(-1, CHUNK)
    for key in range(1, 9):
        buf.seek(0)
        buf.write(vllm_io.chunk_bytes(key, CHUNK))
        path = vllm_io.chunk_path(root, key, namespace=NAMESPACE)
        vllm_io.store(path, buf, use_o_direct)
        if vllm_io.load(path, CHUNK, use_o_direct) != bytes(buf):
            print(f"kvfs: {path} read back wrong bytes", file=sys.stderr)
            return 1
    print(
        f"stored and loaded 8 chunks of {CHUNK >> 20} MiB byte-exact "
        f"({'O_DIRECT' if use_o_direct else 'buffered'}, as vLLM's fs tier would)\n"
    )
    first = Path(vllm_io.chunk_path(root, 1, namespace=NAMESPACE))
    sh("ls", "-l", str(first.parent))
    sh("getfattr", "-d", str(first))
    sh("du", "-sh", str(mnt))
    sh("df", "-h", str(mnt))
    print(f"""
kvfs is mounted at {mnt}. Point vLLM at it:
  --kv-transfer-config '{{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {{"spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 10737418240, "secondary_tiers": [{{"type": "fs", "root_dir": "{mnt}"}}]}}}}'
or, with vLLM's lookups batched into one request per scheduler step (pip install -e '.[vllm]'
in vLLM's environment), the secondary tier {{"type": "KvfsTier", "module_path":
"kvfs.connector.vllm_tier", "root_dir": "{mnt}"}} instead (README: "kvfs as vLLM's secondary tier").
Only the user who mounted it can use it: for vLLM running as another user, mount with
-o allow_other.
If the daemon dies, the mount answers ENOTCONN (never the disk under it): run the same
kvfs mount again, or mount with --supervise to have it restarted by itself.
Unmount with: .venv/bin/kvfs umount {mnt}""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
