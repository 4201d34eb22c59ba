"""kvfs as a secondary tier of vLLM 0.33.0's TieringOffloadingSpec:

    {"type": "KvfsTier", "module_path": "kvfs.connector.vllm_tier", "root_dir": MOUNT_OR_BELOW}

vLLM imports ``module_path`` and takes the class named by ``type`` (no registration needed).
The tier is vLLM's fs tier (same FileMapper, so the same paths and config.json: each reads the
other's files) with two differences. Each scheduler step's keys, of every request, go to the
mount in one batched request (``.kvfs/lookup``, kvfs/control_protocol.py), answered from the
daemon's index, instead of one access() per key, each a FUSE LOOKUP per path component the
kernel has not cached.

And its stores declare each chunk's checksum as they write it (``chunk_io.store_blocks`` with
``declare``: the xxh3 of the bytes in the host region, set on the open file before its close),
so the mount keeps it instead of reading the chunk back from its disk: vLLM writes O_DIRECT,
which a passthrough mount never sees. Past the GiB of such chunks the mount lets wait for their
read-back (``--checksum-backlog``), each publish reads its chunk back itself, and until the
backlog is read the engine's loads share the disk with it (``python -m tools.bench_vllm_tier``,
2 GiB of 2 MiB chunks, three runs: stores at 0.56-0.64 of the plain directory's through the
fs tier, 0.60-0.73 through this one; the loads after them 0.75-0.91 and 0.95-1.11).

The mount's outcomes reach vLLM as job results: a load whose chunk fails its checksum, or
whose read passes the mount's deadline, gets EIO (never wrong bytes), so the job fails with
the keys before it kept (``successful_keys``) and the rest marked as misses, which vLLM then
recomputes; the quarantined chunk is gone from the index, so later lookups miss it. A store
refused at close (ENOSPC, EIO) fails its job, the blocks before it kept, as the fs tier's.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvfs import chunk_io
from kvfs import control_protocol as proto

log = logging.getLogger(__name__)


class BatchedLookups(AsyncLookupManager):
    """vLLM's lookup manager (its verdict cache, RETRY until answered, mark_miss after a failed
    load), whose background thread sends a whole step's keys as one request."""

    def __init__(self, tier: KvfsTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext | None) -> list[bool]:
        names = [self._tier.relative_name(key) for key in keys]
        return self._tier.lookups.ask(self._tier.data_dir, names)

    def _worker(self) -> None:
        """One request per step for every key of every request (vLLM's own thread asks once
        per request)."""
        while True:
            pending = self._lookup_queue.get()
            if pending is None:
                break
            keys = [key for key, _, _ in pending]
            try:
                hits = self.batch_lookup(keys, None)
            except OSError as err:  # the mount is gone or refused: misses, vLLM recomputes
                log.warning("batched lookup of %d keys failed: %s", len(keys), err)
                hits = [False] * len(keys)
            results = [(key, gen, hit) for (key, _, gen), hit in zip(pending, hits, strict=True)]
            self._pending_results.put(results)

    def shutdown(self) -> None:
        super().shutdown()
        self._tier.lookups.close()


class KvfsTier(FileSystemTierManager):
    """vLLM's fs tier on a kvfs mount, with batched lookups and declared checksums (see the
    module's docstring)."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: Any = None,
        **kwargs: Any,
    ) -> None:
        # Checked before the fs tier's __init__ makes directories and config.json under it:
        # a missing mount must not fill the root disk.
        if not isinstance(root_dir, str) or not root_dir:
            raise ValueError(
                f"KvfsTier needs 'root_dir', a path on a kvfs mount (got {root_dir!r})"
            )
        mount = proto.lookup_mount(root_dir)
        if mount is None:  # the fs tier is the one for a plain directory
            raise ValueError(
                f"KvfsTier: root_dir {root_dir} is not on a kvfs mount (mount one with "
                f"`kvfs mount MOUNTPOINT`, or use vLLM's 'fs' tier for a plain directory)"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, root_dir, **kwargs)
        self._lookup_manager.shutdown()  # the fs tier's own: replaced before any lookup
        mapper = self.file_mapper
        prefix = f"{mapper.base_path}_r{mapper.rank}"
        self.lookups = proto.LookupClient(mount)
        # Relative to the mount, symlinks resolved (the mount's lookup follows none).
        real = Path(os.path.realpath(os.path.dirname(prefix))) / os.path.basename(prefix)
        self.data_dir = str(real.relative_to(mount))
        self._prefix_len = len(prefix) + 1
        self._lookup_manager = BatchedLookups(self, self.tier_type)  # type: ignore[assignment]

    def relative_name(self, key: OffloadKey) -> str:
        """A chunk's path under this rank's data directory (vLLM's own name for it)."""
        return str(self.file_mapper.get_file_name(key))[self._prefix_len :]

    def submit_store(self, job_metadata: TransferJob) -> None:
        """The fs tier's store job (one task on its write pool, failed by the first block that
        fails, its keys reported as the fs tier does), each block stored with its checksum
        declared."""
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        if self.events is not None:
            self._store_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        store = functools.partial(
            chunk_io.store_blocks,
            [str(self.file_mapper.get_file_name(key)) for key in keys],
            self._primary_kv_view,
            [int(chunk) * self._block_size for chunk in job_metadata.chunk_ids],
            self._block_size,
            self._use_o_direct,
            declare=True,
        )
        self._pool.enqueue_store(job_id, 1, [store])
