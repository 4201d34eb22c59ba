"""kvfs inside vLLM 0.33.0 by ``spec_module_path``: the README's ``--kv-transfer-config`` lines
parse as vLLM's CLI parses them and load kvfs through vLLM's own factories; an engine of
vLLM's Scheduler + OffloadingConnector (tests/vllm_engine.py) running ``KvfsOffloadingSpec``
moves a request's KV device -> host -> kvfs mount and back byte for byte, asking the mount in
batched lookups; a chunk corrupted on the disk is recomputed, never loaded; bad configs fail
at start with an error that names what is wrong.

On CPU the spec is ``tests.vllm_cpu_spec.CpuKvfsOffloadingSpec``: KvfsOffloadingSpec with only
the worker's CUDA copies replaced by memmoves of vLLM's own copy descriptors (vLLM's worker
asserts CUDA tensors); the real spec's worker is refused on CPU, as vLLM refuses its own."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import vllm_engine
from tests.conftest import Mount
from tests.vllm_engine import BLOCK_SIZE, Engine

UNAVAILABLE = vllm_engine.unavailable()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

README = Path(__file__).resolve().parent.parent / "README.md"
PROMPT = [100 + (i * 7919) % 800 for i in range(16 * BLOCK_SIZE)]  # 16 blocks, 8 chunks
CPU_MODULE = "tests.vllm_cpu_spec"
CPU_SPEC = {"spec_name": "CpuKvfsOffloadingSpec", "spec_module_path": CPU_MODULE}


def readme_line(marker: str) -> str:
    """The README's --kv-transfer-config JSON that mentions ``marker``."""
    found = [
        b
        for b in re.findall(r"--kv-transfer-config '(.*?)'", README.read_text(), re.S)
        if marker in b
    ]
    assert len(found) == 1, f"README gives {len(found)} --kv-transfer-config lines with {marker}"
    return found[0]


def parsed(line: str) -> Any:
    """The line as ``vllm serve`` parses it (arg_utils: TypeAdapter(...).validate_json)."""
    from pydantic import TypeAdapter
    from vllm.config import KVTransferConfig

    return TypeAdapter(KVTransferConfig).validate_json(line)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.write_tiny_model(tmp_path_factory.mktemp("tiny-hybrid"))


def spec_config(root: Path | str, **changes: Any) -> dict[str, Any]:
    """The README's KvfsOffloadingSpec config, on ``root``, with the CPU worker, the engine's
    host size, and ``changes``."""
    extra = dict(parsed(readme_line("KvfsOffloadingSpec")).kv_connector_extra_config)
    del extra["cpu_bytes_to_use"]  # the engine sizes its host tier
    return {**extra, **CPU_SPEC, "root_dir": str(root), **changes}


# -- the README lines ---------------------------------------------------------------------------


def test_the_readme_spec_line_loads_kvfs_through_vllms_factory() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvfs.connector.vllm_spec import KvfsOffloadingSpec, tiering_config
    from kvfs.connector.vllm_tier import KvfsTier

    config = parsed(readme_line("KvfsOffloadingSpec"))
    assert config.kv_connector == "OffloadingConnector" and config.kv_role == "kv_both"
    extra = config.kv_connector_extra_config
    assert extra["spec_module_path"] == "kvfs.connector.vllm_spec"
    assert extra["canonical_layout"] is True
    assert OffloadingSpecFactory.get_spec_cls(extra) is KvfsOffloadingSpec
    # What vLLM's metrics code asks of the class, with the user's config: the tier's too.
    [(tier, cls)] = KvfsOffloadingSpec._get_secondary_tiers(extra)
    assert cls is KvfsTier is SecondaryTierFactory.get_tier_class(dict(tier))
    assert tier == {
        "type": "KvfsTier",
        "module_path": "kvfs.connector.vllm_tier",
        "root_dir": "/mnt/kv-cache",
    }
    tiering = tiering_config(extra)
    assert set(KvfsOffloadingSpec.build_metric_definitions(extra)) == set(
        TieringOffloadingSpec.build_metric_definitions(tiering)
    )
    assert KvfsOffloadingSpec.config_info_keys(extra) == TieringOffloadingSpec.config_info_keys(
        tiering
    )


def test_the_readme_tier_line_loads_kvfs_through_vllms_factories() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvfs.connector.vllm_tier import KvfsTier

    extra = parsed(readme_line("KvfsTier")).kv_connector_extra_config
    assert extra["canonical_layout"] is True  # chunks shared with kvfs's connector
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    [tier] = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is KvfsTier


# -- a request's KV through vLLM and the mount --------------------------------------------------


def tier_config(root: Path) -> dict[str, Any]:
    """The README's TieringOffloadingSpec + KvfsTier config, on ``root``, with the CPU
    worker (tests.vllm_cpu_spec.CpuTieringOffloadingSpec), the engine's host size."""
    extra = dict(parsed(readme_line("KvfsTier")).kv_connector_extra_config)
    del extra["cpu_bytes_to_use"]
    [tier] = extra["secondary_tiers"]
    extra["secondary_tiers"] = [{**tier, "root_dir": str(root)}]
    return {**extra, "spec_name": "CpuTieringOffloadingSpec", "spec_module_path": CPU_MODULE}


def kvfs_engine(model_dir: Path, root: Path, **kwargs: Any) -> Engine:
    return Engine(root, model_dir, extra_config=spec_config(root), **kwargs)


@pytest.mark.parametrize(
    ("line", "layout", "tp"), [("spec", "NHD", 1), ("spec", "HND", 2), ("tier", "NHD", 2)]
)
def test_kv_goes_device_host_mount_and_back_byte_identical(
    model_dir: Path, kv_mount: Mount, line: str, layout: str, tp: int
) -> None:
    from kvfs.connector.vllm_spec import KvfsOffloadingSpec
    from kvfs.connector.vllm_tier import KvfsTier
    from tests.test_vllm_engine import check_files_hold_canonical_pages, check_loaded
    from tests.vllm_cpu_spec import CpuKvfsOffloadingSpec, CpuOffloadingWorker

    root = kv_mount.path / f"{line}-{layout}-{tp}"
    config = spec_config(root) if line == "spec" else tier_config(root)
    with Engine(root, model_dir, extra_config=config, tp=tp, layout=layout) as engine:
        spec = engine.workers[0].connector_worker.spec
        if line == "spec":
            assert isinstance(spec, KvfsOffloadingSpec) and type(spec) is CpuKvfsOffloadingSpec
            # the CPU spec defines nothing: all but the worker (the CPU harness's) is kvfs's
            assert not [n for n, v in vars(CpuKvfsOffloadingSpec).items() if callable(v)]
        else:
            assert not isinstance(spec, KvfsOffloadingSpec)  # vLLM's spec, kvfs's tier only
        assert isinstance(engine.workers[0].connector_worker.worker, CpuOffloadingWorker)
        tier = engine.fs_tier
        assert type(tier) is KvfsTier and tier._use_o_direct
        asked: list[int] = []
        ask = tier.lookups.ask
        tier.lookups.ask = lambda base, names: asked.append(len(names)) or ask(base, names)

        kv = engine.snapshot()
        stored = engine.store(PROMPT)
        assert len(stored.files) == 9  # 8 full-attention chunks + the sliding window's last
        backing = kv_mount.backing / root.relative_to(kv_mount.path)
        kv_mount.settle()
        assert check_files_hold_canonical_pages(engine, stored, kv, root=backing) == 9
        assert asked and sum(asked) >= 8  # the store's lookups went to the mount, batched

        asked.clear()
        loaded = engine.load(PROMPT)  # host tier and device zeroed: the bytes come from the mount
        check_loaded(engine, loaded, stored, kv)
        assert asked and len(asked) < sum(asked)  # fewer requests than keys: batched


def test_a_chunk_corrupted_on_disk_is_recomputed_never_loaded(
    model_dir: Path, kv_mount: Mount
) -> None:
    root = kv_mount.path / "spec-corrupt"
    with kvfs_engine(model_dir, root) as engine:
        kv = engine.snapshot()
        stored = engine.store(PROMPT)
        full = next(g for g in range(len(engine.group_layers)) if not engine.is_sliding(g))
        bad = engine.expected_chunk_files(PROMPT)[full][3]  # the 4th chunk: tokens 96..127
        path = kv_mount.on_backing(bad)
        with open(path, "r+b") as f:  # one flipped byte behind the mount's back
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))

        loaded = engine.load(PROMPT)
        chunk = engine.blocks_per_chunk * BLOCK_SIZE
        # Stops before the bad chunk: here at 0, as the sliding-window group holds only the
        # prompt's last chunk, so no shorter prefix is whole.
        assert loaded.loaded_tokens <= 3 * chunk
        for group, layers in enumerate(engine.group_layers):
            for i, (old, new) in enumerate(
                zip(stored.block_ids[group], loaded.block_ids[group], strict=True)
            ):
                for layer in layers:
                    got = engine.block_kv(layer, new)
                    if i * BLOCK_SIZE < loaded.loaded_tokens and new != 0:
                        assert torch.equal(got, kv[layer][old]), f"group {group} block {i}"
                    elif new != 0:  # recomputed, so never written by a load: still zero
                        assert not got.any(), f"group {group} block {i}: loaded past the hit"
        # The mount quarantined the bad file (the recompute then stored the chunk afresh).
        quarantined = [q.name for q in (kv_mount.backing / ".kvfs" / "quarantine").iterdir()]
        assert [q for q in quarantined if q.startswith("spec-corrupt%") and bad.name in q]


# -- bad configs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"root_dri": "/x"}, r"unknown kv_connector_extra_config key\(s\) \['root_dri'\]"),
        ({"root_dir": None}, "needs 'root_dir'"),
        ({"root_dir": 7}, "needs 'root_dir'"),
        ({"n_read_threads": "4"}, "'n_read_threads' must be an integer >= 1"),
        ({"n_write_threads": 0}, "'n_write_threads' must be an integer >= 1"),
        ({"n_read_threads": True}, "'n_read_threads' must be an integer >= 1"),
        ({"secondary_tiers": {"type": "fs"}}, "'secondary_tiers' .* must be a list"),
    ],
)
def test_a_bad_config_stops_the_engine_naming_the_key(
    model_dir: Path, tmp_path: Path, change: dict[str, Any], error: str
) -> None:
    config = {k: v for k, v in spec_config(tmp_path, **change).items() if v is not None}
    with pytest.raises(ValueError, match=error):
        Engine(tmp_path, model_dir, extra_config=config)


@pytest.mark.parametrize("where", ["plain", "missing"])
def test_a_root_dir_off_any_kvfs_mount_is_refused_before_anything_is_written(
    model_dir: Path, tmp_path: Path, where: str
) -> None:
    root = tmp_path / "plain" if where == "plain" else tmp_path / "no-such-mount" / "kv"
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=f"root_dir {root} is not on a kvfs mount"):
        Engine(root, model_dir, extra_config=spec_config(root))
    assert not any((tmp_path / "plain").iterdir())
    assert not (tmp_path / "no-such-mount").exists()


def test_the_real_spec_refuses_a_cpu_worker_clearly(model_dir: Path, kv_mount: Mount) -> None:
    """What the CPU spec replaces: vLLM's worker copies only CUDA/XPU tensors."""
    root = kv_mount.path / "spec-real"
    config = spec_config(root, spec_name="KvfsOffloadingSpec")
    config["spec_module_path"] = "kvfs.connector.vllm_spec"
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU GPUs"):
        Engine(root, model_dir, extra_config=json.loads(json.dumps(config)))


def test_the_gpu_checks_cpu_half_runs(kv_mount: Mount) -> None:
    """tools/gpu_check.py --vllm-spec compares vLLM's CUDA worker with this harness on a GPU;
    here, only its CPU half runs (so the script is known to work up to the GPU)."""
    from tools.gpu_check import vllm_spec_check

    result = vllm_spec_check(str(kv_mount.path), 2, devices=("cpu",))
    assert result["chunk_files"] == 9 and result["identical"]
