"""The documentation is tested: every python block runs, every link and make target exists.

Each markdown file's ```python blocks are concatenated in order and run in one fresh interpreter,
in an empty working directory, so the examples see each other's names and files the way a reader
who runs them top to bottom would.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, run_python

MARKDOWN_FILES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
REQUIRED_FILES = [
    REPO / "README.md",
    REPO / "docs" / "getting-started.md",
    REPO / "docs" / "concepts.md",
    REPO / "docs" / "api.md",
    REPO / "docs" / "format.md",
]
# Tags that would hide Python code from the runner below.
PYTHON_ALIASES = {"py", "py3", "python3", "pycon", "ipython", "pyi"}
RUN_TIMEOUT_S = 240.0

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
# `make demo` in prose, or a console line "$ make demo".
MAKE_TARGET = re.compile(r"(?:`|^\$ )make\s+(?P<target>[A-Za-z0-9_][A-Za-z0-9_.-]*)", re.MULTILINE)


@dataclass(frozen=True)
class CodeBlock:
    """One fenced code block of a markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence
    language: str
    code: str


def code_blocks(path: Path) -> list[CodeBlock]:
    """Every fenced code block of ``path``, in order."""
    blocks: list[CodeBlock] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        fence = opening["fence"]
        language = opening["info"].strip().split(" ")[0] if opening["info"].strip() else ""
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = FENCE.match(lines[index])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            text = lines[index]
            # Remove the fence's own indentation (as CommonMark does), never more.
            strip = len(text) - len(text.lstrip(" "))
            body.append(text[min(indent, strip) :])
            index += 1
        else:
            pytest.fail(f"{path.relative_to(REPO)}:{start + 1}: code block is never closed")
        blocks.append(CodeBlock(path, start + 1, index + 1, language, "\n".join(body) + "\n"))
        index += 1
    return blocks


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks."""
    inside: set[int] = set()
    for block in code_blocks(path):
        inside.update(range(block.line, block.end + 1))
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(number, text) for number, text in enumerate(lines, 1) if number not in inside]


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub generates for the headings of ``path``."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, text in prose(path):
        heading = HEADING.match(text)
        if heading is None:
            continue
        slug = heading["text"].strip().lower()
        slug = re.sub(r"[^\w\- ]", "", slug).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def rel(path: Path) -> str:
    """``path`` relative to the repository, for messages and test ids."""
    return str(path.relative_to(REPO))


def public_names() -> list[str]:
    """``ckptmgr.__all__``, read without importing the package (and torch)."""
    tree = ast.parse((REPO / "ckptmgr" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(name) for name in value]
    raise AssertionError("ckptmgr/__init__.py has no __all__")


def public_methods(module: str, class_name: str) -> list[str]:
    """Names of the public methods of ``class_name`` defined in ``ckptmgr/<module>.py``."""
    tree = ast.parse((REPO / "ckptmgr" / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [
                item.name
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not item.name.startswith("_")
            ]
    raise AssertionError(f"no class {class_name} in ckptmgr/{module}.py")


def api_headings() -> set[str]:
    """Heading texts of docs/api.md with the backticks removed."""
    texts = set()
    for _, text in prose(REPO / "docs" / "api.md"):
        heading = HEADING.match(text)
        if heading is not None:
            texts.add(heading["text"].replace("`", "").strip())
    return texts


def test_required_documents_exist() -> None:
    missing = [rel(path) for path in REQUIRED_FILES if not path.is_file()]
    assert not missing, f"missing documents: {missing}"


CLOUD_DOCS = {"cloud-storage.md"}  # start the GCS emulator and moto: dev extras


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(path, marks=pytest.mark.cloud) if path.name in CLOUD_DOCS else path
        for path in MARKDOWN_FILES
    ],
    ids=rel,
)
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    blocks = [block for block in code_blocks(path) if block.language == "python"]
    if not blocks:
        pytest.skip(f"{rel(path)} has no python blocks")
    script = tmp_path / "script" / f"{path.stem}_blocks.py"
    script.parent.mkdir()
    workdir = tmp_path / "work"
    workdir.mkdir()
    script.write_text(
        "".join(f"# --- {rel(path)}:{block.line} ---\n{block.code}\n" for block in blocks),
        encoding="utf-8",
    )
    result = run_python(script, timeout=RUN_TIMEOUT_S, cwd=workdir)
    assert result.returncode == 0, (
        f"the python blocks of {rel(path)} failed (exit {result.returncode}); the script's "
        f"'# --- file:line ---' comments map its lines to the markdown\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
    )


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=rel)
def test_code_blocks_are_tagged(path: Path) -> None:
    """Python code must be tagged ```python (so that it runs); other blocks need some tag."""
    untagged = [block.line for block in code_blocks(path) if not block.language]
    aliased = [
        (block.line, block.language)
        for block in code_blocks(path)
        if block.language.lower() in PYTHON_ALIASES
    ]
    assert not untagged, f"{rel(path)}: code blocks without a language at lines {untagged}"
    assert not aliased, f"{rel(path)}: tag python code as ```python, not {aliased}"


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=rel)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for number, text in prose(path):
        for match in LINK.finditer(text):
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"line {number}: {target} (no such file)")
                continue
            if anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
                broken.append(f"line {number}: {target} (no heading #{anchor})")
    assert not broken, f"{rel(path)} has broken links:\n" + "\n".join(broken)


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)\s*:(?!=)", line)
        if rule is not None:
            targets.update(rule.group(1).split())
    return targets


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=rel)
def test_make_targets_exist(path: Path) -> None:
    mentioned = {match["target"] for match in MAKE_TARGET.finditer(path.read_text("utf-8"))}
    missing = sorted(mentioned - makefile_targets())
    assert not missing, f"{rel(path)} mentions make targets the Makefile lacks: {missing}"


def test_readme_quick_start_is_make_demo_and_make_test() -> None:
    """The first command block after the "Quick start" heading is exactly the two commands."""
    readme = REPO / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    heading = lines.index("## Quick start") + 1
    first = next(block for block in code_blocks(readme) if block.line > heading)
    commands = [line.removeprefix("$ ").strip() for line in first.code.splitlines()]
    assert first.language == "console"
    assert commands == ["make demo", "make test"], commands


def test_api_reference_covers_every_public_name() -> None:
    headings = api_headings()
    missing = [name for name in public_names() if name not in headings]
    assert not missing, f"docs/api.md has no section for {missing}"


@pytest.mark.parametrize(
    ("module", "class_name"),
    [("manager", "CheckpointManager"), ("config", "CheckpointConfig")],
)
def test_api_reference_covers_every_public_method(module: str, class_name: str) -> None:
    headings = api_headings()
    missing = [
        f"{class_name}.{name}"
        for name in public_methods(module, class_name)
        if f"{class_name}.{name}" not in headings
    ]
    assert not missing, f"docs/api.md has no section for {missing}"


def test_api_reference_lists_every_setting() -> None:
    """Every CheckpointConfig field appears in the reference (both tables name them)."""
    tree = ast.parse((REPO / "ckptmgr" / "config.py").read_text(encoding="utf-8"))
    config = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "CheckpointConfig"
    )
    fields = [
        node.target.id
        for node in config.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id != "model_config"
    ]
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in fields if api.count(f"| `{name}` |") < 2]
    assert not missing, f"docs/api.md does not describe the settings {missing} in both tables"
