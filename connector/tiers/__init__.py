"""Secondary tiers, and how a tier is found from its configuration.

Built in: ``fs`` (a directory, the kvfs mount first), ``memory`` (the example) and ``p2p``
(other engines' host tiers, over ZMQ and NIXL). Any other
``type`` names a class in ``module_path``: ``{"type": "MyTier", "module_path": "pkg.mod",
...}``; every other key of the dict is a keyword argument of the tier's constructor.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from kvfs.config import ConfigError
from kvfs.connector.tiers.base import SecondaryTier, TierContext

BUILT_IN = {
    "fs": "kvfs.connector.tiers.fs:FsTier",
    "memory": "kvfs.connector.tiers.memory:MemoryTier",
    "p2p": "kvfs.connector.tiers.p2p:P2PTier",
}


def tier_class(kind: str, module_path: str | None, where: str) -> type[SecondaryTier]:
    """The class a tier configuration names; a ConfigError says why when it names none."""
    if module_path is None:
        if kind not in BUILT_IN:
            raise ConfigError(
                f"{where}.type: {kind!r} is not built in ({', '.join(BUILT_IN)}); "
                "give module_path for a tier of your own"
            )
        module_path, kind = BUILT_IN[kind].split(":")
    try:
        cls = getattr(importlib.import_module(module_path), kind)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}: cannot load {kind} from {module_path}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTier)):
        raise ConfigError(f"{where}: {module_path}.{kind} is not a SecondaryTier")
    return cls


def create_tier(
    cls: type[SecondaryTier],
    options: Mapping[str, Any],
    host_view: memoryview,
    context: TierContext,
    where: str,
) -> SecondaryTier:
    """Construct a tier; an unknown or missing option is a ConfigError naming it."""
    try:
        inspect.signature(cls).bind(host_view, context, **options)
    except TypeError as err:
        raise ConfigError(f"{where}: {cls.__name__} {err}") from None
    return cls(host_view, context, **options)
