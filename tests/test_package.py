"""The package's public face: every public name importable from ``ckptmgr``, each imported
from its module on first use (so that ``import ckptmgr`` alone imports no torch: see
``tests/test_cli.py`` for the commands that run without it)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import ckptmgr


def test_every_public_name_is_its_modules_object() -> None:
    for name in ckptmgr.__all__:
        value = getattr(ckptmgr, name)
        if name == "__version__":
            continue
        module = importlib.import_module(ckptmgr._HOMES[name])
        assert value is getattr(module, name), name
    assert sorted(ckptmgr._HOMES) == sorted(set(ckptmgr.__all__) - {"__version__"})


def test_the_imports_for_type_checkers_name_the_same_modules() -> None:
    """The ``if TYPE_CHECKING:`` imports (what type checkers and editors see) import each
    public name from the module ``__getattr__`` imports it from."""
    tree = ast.parse(Path(ckptmgr.__file__).read_text(encoding="utf-8"))
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1
    imported = {
        alias.name: node.module
        for node in blocks[0].body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == ckptmgr._HOMES


def test_dir_lists_the_public_names_and_an_unknown_name_raises_attribute_error() -> None:
    assert set(ckptmgr.__all__) <= set(dir(ckptmgr))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        ckptmgr.NoSuchName  # noqa: B018
    assert not hasattr(ckptmgr, "no_such_module")
    assert not hasattr(ckptmgr, "_no_such_private_module")


def test_a_fresh_import_imports_no_torch_until_a_name_needs_it() -> None:
    program = """
import sys
import ckptmgr
assert "torch" not in sys.modules, "import ckptmgr imported torch"
assert ckptmgr.record.record_bytes is sys.modules["ckptmgr.record"].record_bytes  # a submodule
assert "torch" not in sys.modules, "ckptmgr.record imported torch"
from ckptmgr import *
assert "torch" in sys.modules
assert CheckpointManager is sys.modules["ckptmgr.manager"].CheckpointManager
assert all(name in globals() for name in ckptmgr.__all__)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
