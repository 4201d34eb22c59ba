"""What `pip install 'kvfs[EXTRA]'` brings is what that part of kvfs imports (issue 14, item 11:
the connector extra lacked numpy, which torch needs to hand tensors to the host region)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Imported by a dependency, not by kvfs's own code, and needed all the same.
INDIRECT = {
    "connector": {"numpy"},  # torch warns and cannot convert tensors without it
    "p2p": {"nixl-cu12"},  # imported by name at run time (connector/nixl_data.py)
}
# Modules that run only inside a vLLM process (its plugins): the vllm extra's, not connector's.
VLLM_PLUGINS = {"connector/vllm_tier.py", "connector/vllm_spec.py"}
FILES = {
    "mount": ("kvfs/*.py", "mount/*.py"),
    "connector": ("kvfs/*.py", "connector/*.py"),
    "vllm": ("kvfs/*.py", *VLLM_PLUGINS),
    "p2p": ("kvfs/p2p_protocol.py", "connector/nixl_data.py", "connector/tiers/p2p.py"),
}


def imported_distributions(extra: str) -> set[str]:
    """The distributions whose modules the code of ``extra`` imports."""
    owners = packages_distributions()
    found = set()
    for pattern in FILES[extra]:
        for path in REPO.glob(pattern):
            if extra != "vllm" and str(path.relative_to(REPO)) in VLLM_PLUGINS:
                continue
            for node in _runtime_nodes(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "kvfs":
                        found.update(_normal(d) for d in owners.get(top, [top]))
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for the type checker only)."""
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def _normal(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"][extra]
    return {_normal(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in specs}


@pytest.mark.parametrize("extra", ["mount", "connector", "vllm", "p2p"])
def test_each_extra_declares_what_its_code_imports(extra: str) -> None:
    needed = imported_distributions(extra) | INDIRECT.get(extra, set())
    assert needed - declared(extra) == set()
