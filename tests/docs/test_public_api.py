"""The API reference covers every public name, and a public name without a docstring fails
the docs build (``docs/_ext/public_api.py``, run by ``sphinx -W``).

Skipped where Sphinx is not installed (``pip install -e ".[docs]"``).
"""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "docs" / "_ext"
BUILD_TIMEOUT_S = 120


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def public_api():
    return _load("public_api", EXT / "public_api.py")


@pytest.fixture(scope="module")
def conf():
    return _load("docs_conf", ROOT / "docs" / "conf.py")


def test_every_public_name_has_a_docstring(public_api, conf):
    for modname in conf.public_api_modules:
        assert public_api.public_names(modname), modname
        assert public_api.missing_docstrings(modname) == [], modname


def test_every_public_module_has_an_api_page(conf):
    pages = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.rst"))
    for modname in conf.public_api_modules:
        assert f".. public-api:: {modname}\n" in pages, modname


def _project(tmp_path: Path, package_source: str, modules=("fakepkg",)) -> Path:
    """A Sphinx project documenting ``fakepkg`` with the public_api extension."""
    src = tmp_path / "src"
    (src / "fakepkg").mkdir(parents=True)
    (src / "fakepkg" / "__init__.py").write_text(textwrap.dedent(package_source))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "conf.py").write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(src)!r})
        sys.path.insert(0, {str(EXT)!r})
        extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "public_api"]
        public_api_modules = {list(modules)!r}
        public_api_packages = ["fakepkg"]
        nitpicky = True
        """))
    (docs / "index.rst").write_text("API\n===\n\n.. public-api:: fakepkg\n")
    return docs


def _build(docs: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(docs), str(docs / "_build")],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )


DOCUMENTED = '''\
    """A package."""
    __all__ = ["Thing", "helper", "LIMIT"]

    #: How many things at most.
    LIMIT = 3


    class Thing:
        """A thing."""

        def use(self) -> None:
            """Use it."""


    def helper() -> int:
        """Help.

        Returns:
            A :class:`fakepkg.Thing` count.
        """
        return 1
    '''


def test_a_documented_package_builds(tmp_path):
    done = _build(_project(tmp_path, DOCUMENTED))
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "docs" / "_build" / "index.html").read_text(encoding="utf-8")
    for name in ("fakepkg.Thing", "fakepkg.Thing.use", "fakepkg.helper", "fakepkg.LIMIT"):
        assert f'id="{name}"' in html, name
    assert "How many things at most." in html


@pytest.mark.parametrize("old, new, missing", [
    ('        """Help.\n\n        Returns:\n            A :class:`fakepkg.Thing` count.\n'
     '        """\n', "", "fakepkg.helper"),
    ('        """A thing."""\n', "", "fakepkg.Thing"),
    ('            """Use it."""\n', "            pass\n", "fakepkg.Thing.use"),
    ("    #: How many things at most.\n", "", "fakepkg.LIMIT"),
], ids=["function", "class", "method", "data"])
def test_a_public_name_without_a_docstring_fails_the_build(tmp_path, old, new, missing):
    assert old in DOCUMENTED
    done = _build(_project(tmp_path, DOCUMENTED.replace(old, new, 1)))
    assert done.returncode != 0
    assert f"{missing} has no docstring" in done.stderr, done.stderr


def test_a_broken_reference_into_the_public_api_fails_the_build(tmp_path):
    source = DOCUMENTED.replace(":class:`fakepkg.Thing`", ":class:`fakepkg.Thingy`")
    done = _build(_project(tmp_path, source))
    assert done.returncode != 0
    assert "fakepkg.Thingy" in done.stderr, done.stderr


def test_an_unlisted_public_package_fails_the_build(tmp_path):
    docs = _project(tmp_path, DOCUMENTED)
    sub = tmp_path / "src" / "fakepkg" / "extra"
    sub.mkdir()
    (sub / "__init__.py").write_text('"""More."""\n__all__ = []\n')
    (tmp_path / "src" / "fakepkg" / "_private").mkdir()
    (tmp_path / "src" / "fakepkg" / "_private" / "__init__.py").write_text("")
    done = _build(docs)
    assert done.returncode != 0
    assert "package 'fakepkg.extra' is public" in done.stderr, done.stderr
    assert "_private" not in done.stderr
