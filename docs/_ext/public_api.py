"""The API reference from ``__all__``, and a build that fails on an undocumented public name.

``.. public-api:: distopt.parallel`` documents every name in that module's ``__all__``, in
its order, with autodoc (classes with their public members, functions, and data through
their ``#:`` comment in the module that defines them). Each name must have a docstring of
its own (a class's is not inherited from its base), as must every public method or property
a public class defines without inheriting a docstring: a missing one is a warning, which
``sphinx -W`` turns into a failed build.

Configuration (``conf.py``):

- ``public_api_modules``: the modules whose ``__all__`` make the public surface; each must
  be documented by one ``public-api`` directive somewhere in the docs.
- ``public_api_packages``: the top-level packages to walk; a subpackage of theirs whose
  name has no ``_``-prefixed part, but that is missing from ``public_api_modules``, is a
  warning too, so a new public package cannot go undocumented.

With ``nitpicky = True`` a Python reference that does not resolve warns only when it points
into the public API (``distopt.DistributedOptimizer.sav``); references to torch and to
private modules have no page here and are let go.
"""
import importlib
import importlib.util
import inspect
import pkgutil
import sys
from typing import Any, Dict, List, Optional, Set

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)


def public_names(modname: str) -> List[str]:
    """The names in ``modname.__all__``.

    Raises:
        ValueError: the module has no ``__all__``.
    """
    module = importlib.import_module(modname)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"Invalid public module: {modname!r} has no __all__")
    return list(names)


def _attribute_doc(obj: Any, name: str, modname: str) -> Optional[str]:
    """The ``#:`` comment (or string after the assignment) documenting data ``name``.

    Looked up in the module that defines it: ``modname`` itself or a submodule of its
    top-level package that holds the same object under the same name.
    """
    root = modname.split(".")[0]
    candidates = [modname] + sorted(
        m for m in list(sys.modules) if m == root or m.startswith(root + ".")
    )
    for candidate in candidates:
        module = sys.modules.get(candidate)
        if module is None or vars(module).get(name, _MISSING) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(candidate).find_attr_docs()
        except Exception:  # no source to analyse (a compiled module)
            continue
        lines = docs.get(("", name))
        if lines and "".join(lines).strip():
            return "\n".join(lines)
    return None


_MISSING = object()


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


def _own_doc(obj: Any) -> Optional[str]:
    """A class's or routine's own docstring (a class does not inherit its base's here)."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) and doc.strip() else None


def undocumented_members(cls: type) -> List[str]:
    """Public methods and properties ``cls`` defines with no docstring, own or inherited."""
    missing = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if not (inspect.isfunction(value) or isinstance(value, property)):
            continue
        if not inspect.getdoc(getattr(cls, name, value)):
            missing.append(name)
    return missing


def missing_docstrings(modname: str) -> List[str]:
    """Every public name of ``modname`` (and public member of its classes) without a docstring."""
    module = importlib.import_module(modname)
    missing = []
    for name in public_names(modname):
        obj = getattr(module, name)
        kind = _kind(obj)
        doc = _attribute_doc(obj, name, modname) if kind == "data" else _own_doc(obj)
        if doc is None:
            missing.append(f"{modname}.{name}")
        if inspect.isclass(obj):
            missing += [f"{modname}.{name}.{m}" for m in undocumented_members(obj)]
    return missing


def _entry(modname: str, name: str, obj: Any) -> List[str]:
    """The reStructuredText that documents one public name."""
    full = f"{modname}.{name}"
    kind = _kind(obj)
    if kind in ("class", "exception"):
        return [f".. auto{kind}:: {full}", "   :members:", ""]
    if kind == "function":
        return [f".. autofunction:: {full}", ""]
    doc = _attribute_doc(obj, name, modname) or ""
    lines = [f".. py:data:: {name}", f"   :module: {modname}",
             f"   :type: {type(obj).__name__}", ""]
    lines += ["   " + line if line else "" for line in doc.splitlines()]
    return lines + [""]


class PublicApiDirective(SphinxDirective):
    """``.. public-api:: MODULE``: every name in ``MODULE.__all__``, documented by autodoc."""

    required_arguments = 1
    has_content = False

    def run(self) -> List[nodes.Node]:
        modname = self.arguments[0]
        location = self.get_location()
        try:
            module = importlib.import_module(modname)
            names = public_names(modname)
        except Exception as exc:  # reported as a warning: -W fails the build
            logger.warning(f"public-api: cannot document {modname!r}: {exc}", location=location)
            return []
        for missing in missing_docstrings(modname):
            logger.warning(
                f"public-api: {missing} has no docstring (every name in __all__, and every "
                "public method of a public class, must have one)",
                location=location,
            )
        _documented(self.env).setdefault(self.env.docname, set()).add(modname)
        lines = [f".. automodule:: {modname}", "   :no-members:", ""]
        for name in names:
            lines += _entry(modname, name, getattr(module, name))
        node = nodes.container()
        source = StringList(lines, source=f"<public-api {modname}>")
        nested_parse_with_titles(self.state, source, node)
        return node.children


def _documented(env: Any) -> Dict[str, Set[str]]:
    if not hasattr(env, "public_api_documented"):
        env.public_api_documented = {}
    return env.public_api_documented


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    _documented(env).pop(docname, None)


def _merge(app: Sphinx, env: Any, docnames: Set[str], other: Any) -> None:
    for docname, modules in _documented(other).items():
        if docname in docnames:
            _documented(env)[docname] = set(modules)


def _check_packages(app: Sphinx) -> None:
    """Warn about a public package missing from ``public_api_modules``."""
    listed = set(app.config.public_api_modules)
    for top in app.config.public_api_packages:
        package = importlib.import_module(top)
        found = [top] + [
            info.name
            for info in pkgutil.walk_packages(package.__path__, prefix=top + ".")
            if info.ispkg
        ]
        for name in found:
            if any(part.startswith("_") for part in name.split(".")):
                continue
            if name not in listed:
                logger.warning(
                    f"public-api: package {name!r} is public (no _ in its name) but not in "
                    "public_api_modules of docs/conf.py: list it and give it an API page"
                )


def _check_coverage(app: Sphinx, env: Any) -> None:
    """Every module of ``public_api_modules`` is documented by some ``public-api`` directive."""
    documented: Set[str] = set()
    for modules in _documented(env).values():
        documented |= modules
    for modname in app.config.public_api_modules:
        if modname not in documented:
            logger.warning(
                f"public-api: {modname!r} is in public_api_modules but no page has "
                f"'.. public-api:: {modname}'"
            )


def _names_nothing(app: Sphinx, target: str) -> Optional[bool]:
    """Whether an unresolved ``target`` is a broken link into the public API.

    None when it lies outside every public module (torch's names). Under a public module
    it is broken when its first part after the module is one of the module's public names
    (a member that does not exist: a renamed method) or names nothing at all (a typo);
    a submodule or other attribute that is not public (``distopt.checkpoint``) has no
    page here and is let go.
    """
    for modname in sorted(app.config.public_api_modules, key=len, reverse=True):
        if not target.startswith(modname + "."):
            continue
        first = target[len(modname) + 1:].split(".")[0]
        if first in public_names(modname):
            return True
        module = importlib.import_module(modname)
        if hasattr(module, first):
            return False
        try:
            return importlib.util.find_spec(f"{modname}.{first}") is None
        except (ImportError, ValueError):
            return True
    return None


def _only_public_references(app: Sphinx, domain: Any, node: Any) -> Optional[bool]:
    """Keep the warning for a Python reference into the public API that does not resolve.

    With ``nitpicky`` every unresolved reference warns; references to torch's names, and
    to distopt's private modules that docstrings mention (``distopt.checkpoint``), have no
    page here and are let go. A reference by full name into a public module that does not
    resolve (a renamed method, a typo) is a broken link, and stays a warning; names
    relative to the current module are not checked.
    """
    if domain is None or domain.name != "py":
        return None
    if _names_nothing(app, node.get("reftarget", "")):
        return None
    return True


def setup(app: Sphinx) -> Dict[str, Any]:
    app.add_config_value("public_api_modules", [], "env")
    app.add_config_value("public_api_packages", [], "env")
    app.add_directive("public-api", PublicApiDirective)
    app.connect("builder-inited", _check_packages)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check_coverage)
    app.connect("warn-missing-reference", _only_public_references)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
