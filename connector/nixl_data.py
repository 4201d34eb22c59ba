"""The p2p tier's data plane: one NIXL agent over the host region, RDMA-style WRITEs into a
peer's host rows (UCX; host memory over TCP/shared memory on one machine, RDMA between hosts).

The server side pushes, as in vLLM: it writes its rows into the rows the asker named. The
whole host region is registered once (as a torch tensor over the same memory) and described
row by row, so a write is two lists of row indexes. Every call comes from one thread.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import uuid
from types import ModuleType
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# The wheels' module names: ``nixl`` is the meta package (it picks one of the others by CUDA
# version); ``nixl-cu12`` alone installs ``nixl_cu12``.
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def load_nixl() -> ModuleType:
    """NIXL's Python API, or ImportError saying what was tried."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except Exception as err:  # a wheel for another CUDA can fail with OSError too
            errors.append(f"{name}: {type(err).__name__}: {err}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors))


def nixl_unavailable() -> str | None:
    """Why NIXL cannot run here (None: it can)."""
    try:
        load_nixl()
    except ImportError as err:
        return str(err)
    return None


class NixlData:
    def __init__(
        self, host_view: memoryview, backends: list[str] | None = None, num_threads: int = 0
    ) -> None:
        api = load_nixl()
        assert host_view.shape is not None and host_view.strides is not None
        self.num_rows = host_view.shape[0]
        self.row_bytes = host_view.strides[0]
        self.name = f"kvfs-{uuid.uuid4()}"
        backends = list(backends or ["UCX"])
        self._agent: Any = api.nixl_agent(
            self.name, api.nixl_agent_config(backends=[b for b in backends if b != "UCX"])
        )
        if "UCX" in backends:
            params = {"engine_config": "TLS=^rc_gda"}  # host memory only, as vLLM's p2p tier
            if num_threads > 0:
                params["num_threads"] = str(num_threads)
            self._agent.create_backend("UCX", params)
        # The same memory as the host region, as a tensor NIXL registers in one piece.
        self._tensor = torch.frombuffer(host_view.cast("B"), dtype=torch.uint8)
        self.base_addr = self._tensor.data_ptr()
        self._reg = self._agent.register_memory(self._tensor)
        rows = [
            (self.base_addr + i * self.row_bytes, self.row_bytes, 0) for i in range(self.num_rows)
        ]
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._agent.get_xfer_descs(rows, mem_type="DRAM")
        )
        self._peers: dict[str, tuple[str, Any, int]] = {}  # peer -> (agent, rows, row count)
        self._inflight: dict[int, tuple[str, Any]] = {}
        self._ids = itertools.count(1)

    @property
    def metadata(self) -> bytes:
        data: bytes = self._agent.get_agent_metadata()
        return data

    def add_peer(
        self, peer: str, metadata: bytes, base_addr: int, num_rows: int, row_bytes: int
    ) -> None:
        self.remove_peer(peer)
        name = self._agent.add_remote_agent(metadata)
        try:
            rows = [(base_addr + i * row_bytes, row_bytes, 0) for i in range(num_rows)]
            handle = self._agent.prep_xfer_dlist(
                name, self._agent.get_xfer_descs(rows, mem_type="DRAM")
            )
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        self._peers[peer] = (name, handle, num_rows)

    def peer_rows(self, peer: str) -> int:
        entry = self._peers.get(peer)
        return entry[2] if entry else 0

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        name, handle, _ = entry
        for call, arg in (
            (self._agent.release_dlist_handle, handle),
            (self._agent.remove_remote_agent, name),
        ):
            try:
                call(arg)
            except Exception as err:
                log.warning("p2p: releasing peer %s: %s", peer, err)

    def write(self, peer: str, local_rows: list[int], remote_rows: list[int]) -> int:
        """Start writing our rows into the peer's rows; a transfer id for :meth:`poll`."""
        _, remote, _ = self._peers[peer]
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            self._local,
            np.asarray(local_rows, dtype=np.int32),
            remote,
            np.asarray(remote_rows, dtype=np.int32),
        )
        try:
            if self._agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer posted with status ERR")
        except Exception:
            self._release(handle)
            raise
        transfer = next(self._ids)
        self._inflight[transfer] = (peer, handle)
        return transfer

    def poll(self) -> tuple[list[int], list[int]]:
        """Transfers finished since the last poll: (done, failed)."""
        done: list[int] = []
        failed: list[int] = []
        for transfer, (_, handle) in list(self._inflight.items()):
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as err:
                log.warning("p2p: transfer %d: %s", transfer, err)
                state = "ERR"
            if state in ("PROC", "PEND"):
                continue
            del self._inflight[transfer]
            self._release(handle)
            (done if state == "DONE" else failed).append(transfer)
        return done, failed

    def forget(self, peer: str) -> None:
        """Release the handles of the peer's writes that never ended (the peer is gone)."""
        for transfer, (owner, handle) in list(self._inflight.items()):
            if owner == peer:
                del self._inflight[transfer]
                self._release(handle)

    def inflight(self, peer: str | None = None) -> int:
        return sum(1 for p, _ in self._inflight.values() if peer is None or p == peer)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as err:
            log.warning("p2p: releasing a transfer handle: %s", err)

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for _, handle in self._inflight.values():
            self._release(handle)
        self._inflight.clear()
        try:
            self._agent.release_dlist_handle(self._local)
            self._agent.deregister_memory(self._reg)
        except Exception as err:
            log.warning("p2p: closing the NIXL agent: %s", err)
