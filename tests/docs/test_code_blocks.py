"""Every Python block in the documentation parses, and the runnable ones run.

The documentation is README.md, CONTRIBUTING.md, examples/README.md and docs/ (Markdown and
reStructuredText). A Python block is a Markdown fence opened with ``python`` or ``py``, a
MyST ``{code-block} python`` fence, or an RST ``.. code-block:: python`` / ``.. code::
python``. Each is parsed with ``ast.parse``. A block whose first line is the comment
``# runnable`` (or whose directive has ``:class: runnable``) runs on its own, in a fresh
interpreter in an empty folder, within ``RUN_TIMEOUT_S``: such a block must run on one
machine in seconds and start whatever processes it needs itself. ``MASTER_ADDR`` and
``MASTER_PORT`` (a free loopback port) are in its environment, as torchrun would set them.
"""
import ast
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import List, NamedTuple, Tuple

import pytest

from tests import worlds

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a runnable block may take (they took 3 to 21 s each on 2 busy cores).
RUN_TIMEOUT_S = 180
MARKER = "# runnable"


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the block's first code line
    code: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documentation_files() -> List[Path]:
    """README.md, CONTRIBUTING.md, examples/README.md and every page under docs/."""
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "examples" / "README.md"]
    docs = ROOT / "docs"
    files += sorted(
        p for p in docs.rglob("*")
        if p.suffix in (".md", ".rst") and "_build" not in p.relative_to(docs).parts
    )
    return [p for p in files if p.is_file()]


_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
_MYST_PYTHON = re.compile(r"^\{(code-block|code|sourcecode)\}\s+(python|py|python3)\b")
_RST_PYTHON = re.compile(
    r"^(?P<indent> *)\.\. (code-block|code|sourcecode):: *(python|py|python3)\s*$")


def _options_and_body(lines: List[str]) -> Tuple[List[str], int]:
    """Split a directive's leading ``:option: value`` lines from its code."""
    options, i = [], 0
    while i < len(lines) and re.match(r"^\s*:[\w-]+:", lines[i]):
        options.append(lines[i].strip())
        i += 1
    if options and i < len(lines) and not lines[i].strip():
        i += 1
    return options, i


def _block(path: Path, first_line: int, lines: List[str], options: List[str]) -> Block:
    code = "\n".join(lines)
    stripped = [l for l in lines if l.strip()]
    runnable = any(re.fullmatch(r":class:.*\brunnable\b.*", o) for o in options) or bool(
        stripped and stripped[0].strip() == MARKER
    )
    return Block(path, first_line, code, runnable)


def markdown_blocks(path: Path) -> List[Block]:
    """The Python blocks of a Markdown (MyST) file."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = len(match["indent"]), match["fence"], match["info"].strip()
        end = i + 1
        while end < len(lines) and not re.match(
            rf"^ {{0,{indent + 3}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        body = [l[indent:] if l[:indent].strip() == "" else l for l in lines[i + 1:end]]
        language = info.split()[0].lower() if info else ""
        if language in ("python", "py", "python3"):
            blocks.append(_block(path, i + 2, body, []))
        elif _MYST_PYTHON.match(info):
            options, skip = _options_and_body(body)
            blocks.append(_block(path, i + 2 + skip, body[skip:], options))
        i = end + 1
    return blocks


def rst_blocks(path: Path) -> List[Block]:
    """The Python blocks of a reStructuredText file."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = _RST_PYTHON.match(lines[i])
        if not match:
            i += 1
            continue
        indent = len(match["indent"])
        end = i + 1
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
        ):
            end += 1
        body = lines[i + 1:end]
        options, skip = _options_and_body(body)
        while skip < len(body) and not body[skip].strip():
            skip += 1
        code = body[skip:]
        while code and not code[-1].strip():
            code.pop()
        width = min((len(l) - len(l.lstrip()) for l in code if l.strip()), default=0)
        blocks.append(_block(path, i + 2 + skip, [l[width:] for l in code], options))
        i = end
    return blocks


def all_blocks() -> List[Block]:
    blocks = []
    for path in documentation_files():
        blocks += rst_blocks(path) if path.suffix == ".rst" else markdown_blocks(path)
    return blocks


BLOCKS = all_blocks()


def test_the_documentation_has_python_blocks_and_runnable_ones():
    assert len(BLOCKS) >= 20, [b.where for b in BLOCKS]
    readme = [b for b in BLOCKS if b.path.name == "README.md" and b.path.parent == ROOT]
    assert any(b.runnable for b in readme), "README.md has no runnable block"
    assert sum(b.runnable for b in BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_parses(block: Block):
    try:
        ast.parse(block.code, filename=block.where)
    except SyntaxError as exc:
        line = block.line + (exc.lineno or 1) - 1
        pytest.fail(f"{block.path.relative_to(ROOT)}:{line}: {exc.msg}\n{block.code}")


RUNNABLE = [b for b in BLOCKS if b.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block_runs(block: Block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code + "\n", encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(worlds.free_port()))
    job = worlds.Job()
    # a session of its own: past the limit the block's own processes are killed too
    job.start([sys.executable, str(script)], env=env, cwd=str(tmp_path), session=True)
    code = job.wait(RUN_TIMEOUT_S)[0]
    if code is None:
        pytest.fail(f"{block.where}: still running after {RUN_TIMEOUT_S} s\n{job.text(0)}")
    assert code == 0, f"{block.where} exited with {code}\n--- output\n{job.text(0)}"


def test_blocks_are_found_in_every_form(tmp_path):
    md = tmp_path / "page.md"
    md.write_text(textwrap.dedent("""\
        Text.

        ```python
        a = 1
        ```

        - a list item:

          ```py
          # runnable
          b = 2
          ```

        ```{code-block} python
        :class: runnable

        c = 3
        ```

        ```bash
        echo not python
        ```
        """))
    found = [(b.line, b.code, b.runnable) for b in markdown_blocks(md)]
    assert found == [(4, "a = 1", False), (10, "# runnable\nb = 2", True), (17, "c = 3", True)]
    rst = tmp_path / "page.rst"
    rst.write_text(textwrap.dedent("""\
        Title
        =====

        .. code-block:: python

           x = 1
           if x:
               y = 2

        .. code-block:: python
           :class: runnable

           z = 3

        Done.
        """))
    found = [(b.line, b.code, b.runnable) for b in rst_blocks(rst)]
    assert found == [(6, "x = 1\nif x:\n    y = 2", False), (13, "z = 3", True)]
