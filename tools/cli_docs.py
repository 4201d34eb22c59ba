"""Regenerate docs/cli/*.md: every `kvfs` command's --help and real output on a scratch mount.

    python -m tools.cli_docs

Run it (as root) whenever a command's behaviour changes; the pages show what it printed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tools import vllm_io

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli"
KVFS = [sys.executable, "-m", "kvfs.cli"]


REPLACE: dict[str, str] = {}  # scratch paths -> the paths the pages show


def run(command: list[str], shown: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    text = f"$ {shown}\n{done.stdout}{done.stderr}".rstrip() + "\n"
    for scratch, nice in REPLACE.items():
        text = text.replace(scratch, nice)
    return text


def page(name: str, summary: str, examples: list[tuple[list[str], str]]) -> None:
    help_text = subprocess.run([*KVFS, name, "--help"], capture_output=True, text=True).stdout
    body = [
        f"# kvfs {name}\n",
        f"{summary}\n",
        "```text",
        help_text.rstrip(),
        "```\n",
        "Example (real output):\n",
        "```text",
    ]
    body += [run(command, shown) for command, shown in examples]
    body.append("```\n")
    (DOCS / f"{name}.md").write_text("\n".join(body))


def main() -> int:
    DOCS.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="kvfs-docs-"))
    mnt, backing = base / "kv-cache", base / "backing"
    mnt.mkdir()
    m, b = "/mnt/kv-cache", "/var/cache/kvfs/mnt_kv-cache"  # how the pages show the paths

    REPLACE.update({str(mnt): m, str(backing): b})

    def shown(command: list[str]) -> str:
        return " ".join(command).replace(str(mnt), m).replace(str(backing), b)

    def ex(*args: str) -> tuple[list[str], str]:
        return [*KVFS, *args], shown(["kvfs", *args])

    try:
        page(
            "mount",
            "Mount a kvfs tier; returns once the mount answers.",
            [
                ex("mount", str(mnt), "-o", "auto_unmount"),  # refused: nothing is mounted
                ex("mount", str(mnt), "--backing", str(backing), "--capacity", "64M"),
            ],
        )
        ns = "demo-llama_5f1d2c3b4a69"
        (mnt / ns).mkdir()
        (mnt / ns / "config.json").write_text(
            json.dumps(
                {
                    "model_name": "meta-llama/Llama-3.1-8B",
                    "dtype": "bfloat16",
                    "blocks_per_file": 1,
                    "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
                }
            )
        )
        for key in range(12):
            vllm_io.store(
                vllm_io.chunk_path(str(mnt), key, namespace=ns), vllm_io.chunk_bytes(key, 2 << 20)
            )
        for key in range(4):
            vllm_io.load(vllm_io.chunk_path(str(mnt), key, namespace=ns), 2 << 20)
        chunk = vllm_io.chunk_path(str(mnt), 1, namespace=ns)
        page("ls", "A table per namespace, from the running daemon.", [ex("ls", str(mnt))])
        page("du", "Usage against the capacity, per namespace.", [ex("du", str(mnt))])
        page("stat", "What the daemon knows of one file or directory.", [ex("stat", chunk)])
        page(
            "top",
            "A live view of the daemon's rates and queues.",
            [ex("top", str(mnt), "--interval", "1", "--count", "2")],
        )
        page(
            "verify",
            "Check every chunk against its checksum; quarantine bad ones.",
            [ex("verify", str(mnt))],
        )
        page(
            "evict",
            "Evict a namespace, or chunks not read for a while.",
            [
                ex("evict", str(mnt), "--older-than", "1h"),
                ex("evict", str(mnt), "--namespace", ns, "--dry-run"),
                ex("evict", str(mnt), "--namespace", ns),
            ],
        )
        page("umount", "Unmount and wait for the daemon to exit.", [ex("umount", str(mnt))])
    finally:
        subprocess.run([*KVFS, "umount", str(mnt)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
