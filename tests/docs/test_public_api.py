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
        autodoc_default_options = {{"show-inheritance": True}}
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


# ------------------------------------------------------ no private name on a public page


@pytest.fixture
def owners_module(tmp_path, monkeypatch):
    """An importable module ``privfix`` whose class ``Thing`` has a private method."""
    (tmp_path / "privfix.py").write_text(textwrap.dedent('''\
        class Thing:
            """A thing."""

            def use(self):
                """Use it."""

            def _helper(self):
                pass
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "privfix"


def _object(module: str, fullname: str, signature: str = "", bases: str = "", text=()):
    """A doctree holding one documented Python object, as autodoc builds it."""
    from docutils import nodes
    from sphinx import addnodes

    desc = addnodes.desc(domain="py", objtype="class")
    sig = addnodes.desc_signature("", "", module=module, fullname=fullname)
    sig += addnodes.desc_addname(f"{module}.", f"{module}.")
    sig += addnodes.desc_name(fullname.split(".")[-1], fullname.split(".")[-1])
    if signature:
        sig += addnodes.desc_parameterlist(signature, signature)
    desc += sig
    content = addnodes.desc_content()
    if bases:
        content += nodes.paragraph("", "", nodes.Text("Bases: "), nodes.literal(bases, bases))
    for literal in text:
        content += nodes.paragraph("", "", nodes.Text("See "), nodes.literal(literal, literal))
    desc += content
    document = nodes.section()
    document += desc
    return document


@pytest.mark.parametrize("where, found", [
    ({"bases": "privfix._Base"}, "'privfix._Base' in the bases of privfix.Thing"),
    ({"fullname": "Thing._helper"}, "'_helper' in the name of privfix.Thing._helper"),
    ({"signature": "x, _cache=None"}, "'_cache' in the signature of privfix.Thing"),
    ({"signature": "x=_MISSING"}, "'_MISSING' in the signature of privfix.Thing"),
    ({"text": ["_helper"]}, "'_helper' in the text of privfix.Thing"),
    ({"text": ["privfix._native"]}, "'privfix._native' in the text of privfix.Thing"),
], ids=["base", "member", "parameter", "default", "own-attribute", "own-module"])
def test_the_check_finds_a_private_name_on_a_public_page(public_api, owners_module, where,
                                                        found):
    """Each place a private name can show on an API page is found: a base, a member's name, a
    parameter, a default, and in the text a private attribute of the documented class or a
    private module of the project."""
    doctree = _object(owners_module, where.pop("fullname", "Thing"), **where)
    messages = [what for _, what in public_api.private_names(doctree, ["privfix"])]
    assert messages == [found]


def test_the_check_lets_public_names_dunders_and_torch_s_names_go(public_api, owners_module):
    """Public names, dunders, a private-looking word that names nothing of the class, and
    torch's own private kernels named in prose pass."""
    doctree = _object(
        owners_module, "Thing.__init__", signature="params, lr=0.001, *, foreach=None",
        bases="privfix.Root, object",
        text=["torch._foreach_add_", "torch._fused_adam_", "_not_an_attribute", "use",
              "__call__"],
    )
    assert public_api.private_names(doctree, ["privfix"]) == []


def test_hidden_bases_show_as_the_nearest_public_ones(public_api):
    """A private base, or a class of the project that no page documents, shows as the nearest
    public base (object only when nothing else is left); other bases stay."""
    class Root:
        pass

    class _Base(Root):
        pass

    class Mixin:  # of this project but on no page: hidden too
        pass

    Mixin.__module__ = "privfix.plan"
    public = {Root: "privfix.Root"}
    assert public_api.shown_bases([_Base], public, ["privfix"]) == [":py:class:`privfix.Root`"]
    shown = public_api.shown_bases([Mixin, Root], public, ["privfix"])
    assert shown == [":py:class:`privfix.Root`"]
    assert public_api.shown_bases([Mixin], public, ["privfix"]) == [object]
    assert public_api.shown_bases([ValueError], public, ["privfix"]) == [ValueError]


PRIVATE_BASE = '''\
    """A package."""
    __all__ = ["Thing", "Root"]


    class Root:
        """The public base."""

        def base_only(self) -> None:
            """Documented on Root's entry only."""


    class _Base(Root):
        def shared(self) -> None:
            """A public method a public class gets from a private base."""


    class Thing(_Base):
        """A thing."""
    '''


def test_a_private_base_shows_as_its_public_base_with_its_members(tmp_path):
    """Built with -W: Bases names the public base, the public method of the private base is
    documented on the subclass, and no private name is left on the page."""
    done = _build(_project(tmp_path, PRIVATE_BASE))
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "docs" / "_build" / "index.html").read_text(encoding="utf-8")
    body = html.split('role="main"')[1]
    assert "_Base" not in body
    bases = body.split('id="fakepkg.Thing"')[1].split("Bases:")[1].split("</p>")[0]
    assert 'title="fakepkg.Root"' in bases, bases
    assert 'id="fakepkg.Thing.shared"' in body
    assert 'id="fakepkg.Thing.base_only"' not in body
    # the page follows __all__ (Thing first), with a summary of every name on top
    assert body.index('id="fakepkg.Thing"') < body.index('id="fakepkg.Root"')
    assert "On this page" in body


PRIVATE_NAMES = '''\
    """A package; its private module is ``fakepkg._impl``."""
    __all__ = ["Thing", "helper"]


    class Thing:
        """A thing; see ``_secret``."""

        def _secret(self) -> None:
            pass


    def helper(x, _cache=None) -> int:
        """Help."""
        return 1
    '''


def test_a_private_name_on_a_public_page_fails_the_build(tmp_path):
    """A private module in the module's docstring, a private method named in a class's
    docstring, and a private parameter each fail sphinx -W, named."""
    done = _build(_project(tmp_path, PRIVATE_NAMES))
    assert done.returncode != 0
    for what in ("'fakepkg._impl' in the text of the page",
                 "'_secret' in the text of fakepkg.Thing",
                 "'_cache' in the signature of fakepkg.helper"):
        assert f"private name {what} on a public page" in done.stderr, done.stderr
