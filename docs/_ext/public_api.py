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

No private name on a public page. A base class whose name starts with ``_`` is shown as its
nearest shown bases (``Bases: _Dense`` becomes ``Bases: distopt.parallel.Compression``), as
is a class of this project that no page documents (a private base class); a public
base is shown by its documented name; and the public methods a class gets from such hidden
bases are documented on the class itself (they are its API). Then every page with a
``public-api`` directive is read once more (``private_names``): a ``_``-prefixed name in a
documented object's name, signature (parameters, defaults, annotations) or ``Bases:`` line,
or one of this project's private names in its text (``_next_plan`` of the class it
documents, ``functional._native``), is a warning, which ``sphinx -W`` turns into a failed
build. Dunder names (``__init__``) are public protocol and pass, as do torch's private names
in prose (``torch._fused_adam_``: the kernel a class runs).
"""
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
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


def is_private(name: str) -> bool:
    """``_name`` or ``_Name`` (private by convention); ``__init__``-style dunders are not, nor
    is a bare ``_``."""
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and bool(name.strip("_")) and not dunder


def _private_class(cls: type) -> bool:
    qualname = getattr(cls, "__qualname__", cls.__name__)
    return any(is_private(part) for part in qualname.split("."))


def hidden(cls: Any, public: Optional[Dict[Any, str]] = None,
           packages: Sequence[str] = ()) -> bool:
    """Whether a base class has no place on a public page: a private one (``_Dense``), or
    one of ``packages``'s that is not among the ``public`` classes (a private base)."""
    if not inspect.isclass(cls):
        return False
    if _private_class(cls):
        return True
    try:
        listed = public is not None and cls in public
    except TypeError:
        return False
    ours = (getattr(cls, "__module__", "") or "").split(".")[0] in packages
    return ours and not listed


def private_bases(cls: type, public: Optional[Dict[Any, str]] = None,
                  packages: Sequence[str] = ()) -> List[type]:
    """The hidden classes (see ``hidden``) ``cls`` inherits from before its first shown base,
    in MRO order.

    Their public members are ``cls``'s own API: the page documents them on ``cls``.
    """
    found = []
    for base in cls.__mro__[1:]:
        if not hidden(base, public, packages):
            break
        found.append(base)
    return found


def undocumented_members(cls: type, public: Optional[Dict[Any, str]] = None,
                         packages: Sequence[str] = ()) -> List[str]:
    """Public methods and properties ``cls`` (or a hidden base of it, see ``private_bases``)
    defines with no docstring, own or inherited."""
    missing: List[str] = []
    for owner in [cls] + private_bases(cls, public, packages):
        for name, value in vars(owner).items():
            if name.startswith("_") or name in missing:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if not (inspect.isfunction(value) or isinstance(value, property)):
                continue
            if not inspect.getdoc(getattr(cls, name, value)):
                missing.append(name)
    return missing


def missing_docstrings(modname: str, public: Optional[Dict[Any, str]] = None,
                       packages: Sequence[str] = ()) -> List[str]:
    """Every public name of ``modname`` (and public member of its classes, with those of
    their hidden bases) without a docstring."""
    module = importlib.import_module(modname)
    missing = []
    for name in public_names(modname):
        obj = getattr(module, name)
        kind = _kind(obj)
        doc = _attribute_doc(obj, name, modname) if kind == "data" else _own_doc(obj)
        if doc is None:
            missing.append(f"{modname}.{name}")
        if inspect.isclass(obj):
            missing += [f"{modname}.{name}.{m}"
                        for m in undocumented_members(obj, public, packages)]
    return missing


def _entry(modname: str, name: str, obj: Any, public: Optional[Dict[Any, str]] = None,
           packages: Sequence[str] = ()) -> List[str]:
    """The reStructuredText that documents one public name."""
    full = f"{modname}.{name}"
    kind = _kind(obj)
    if kind in ("class", "exception"):
        lines = [f".. auto{kind}:: {full}", "   :members:"]
        behind = private_bases(obj, public, packages)
        if behind:
            # autodoc leaves out members of the classes named here (the first shown base
            # on): what the hidden bases define is documented on this class.
            stop = [c.__name__ for c in obj.__mro__[1 + len(behind):]]
            lines.append(f"   :inherited-members: {', '.join(stop)}")
        return lines + [""]
    if kind == "function":
        return [f".. autofunction:: {full}", ""]
    doc = _attribute_doc(obj, name, modname) or ""
    lines = [f".. py:data:: {name}", f"   :module: {modname}",
             f"   :type: {type(obj).__name__}", ""]
    lines += ["   " + line if line else "" for line in doc.splitlines()]
    return lines + [""]


def _first_line(obj: Any, name: str, modname: str) -> str:
    """The first sentence of a public name's docstring, on one line ("" without one)."""
    doc = _attribute_doc(obj, name, modname) if _kind(obj) == "data" else _own_doc(obj)
    paragraph = inspect.cleandoc(doc or "").split("\n\n")[0]
    line = " ".join(paragraph.split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", line)  # "(e.g. ...)" ends nothing
    return (line[:end.start() + 1] if end else line).rstrip(":")


def _summary(modname: str, names: Sequence[str], module: Any) -> List[str]:
    """A list of the page's names with their first sentences, in ``__all__``'s order: the
    whole module at a glance, before the long entries."""
    lines = [".. rubric:: On this page", ""]
    for name in names:
        first = _first_line(getattr(module, name), name, modname)
        lines.append(f"- :py:obj:`~{modname}.{name}`" + (f": {first}" if first else ""))
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
        public, packages = _public_classes(self.config), _packages(self.config)
        for missing in missing_docstrings(modname, public, packages):
            logger.warning(
                f"public-api: {missing} has no docstring (every name in __all__, and every "
                "public method of a public class, must have one)",
                location=location,
            )
        _documented(self.env).setdefault(self.env.docname, set()).add(modname)
        lines = [f".. automodule:: {modname}", "   :no-members:", ""]
        lines += _summary(modname, names, module)
        for name in names:
            lines += _entry(modname, name, getattr(module, name), public, packages)
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


def _public_classes(config: Any) -> Dict[Any, str]:
    """Every public class, by the name its page documents (``distopt.parallel.Cast``)."""
    found: Dict[Any, str] = {}
    for modname in config.public_api_modules:
        module = importlib.import_module(modname)
        for name in public_names(modname):
            obj = getattr(module, name, None)
            if inspect.isclass(obj):
                found.setdefault(obj, f"{modname}.{name}")
    return found


def shown_bases(bases: Iterable[Any], public: Dict[Any, str],
                packages: Sequence[str] = ()) -> List[Any]:
    """``bases`` as a public page shows them: a hidden one (see ``hidden``) replaced by its
    nearest shown bases, a public one by its documented name (a reST reference); ``object``
    only alone."""
    shown: List[Any] = []
    for base in bases:
        try:
            documented = public.get(base)
        except TypeError:  # an unhashable generic alias
            documented = None
        if documented is not None:
            items: List[Any] = [f":py:class:`{documented}`"]
        elif hidden(base, public, packages):
            items = shown_bases(base.__bases__, public, packages)
        else:
            items = [base]
        shown += [item for item in items if item not in shown]
    if len(shown) > 1 and object in shown:
        shown.remove(object)
    return shown


def _process_bases(app: Sphinx, name: str, obj: Any, options: Any, bases: List[Any]) -> None:
    """``autodoc-process-bases``: no private base on a public page (``Bases: _Dense``)."""
    bases[:] = shown_bases(list(bases), _public_classes(app.config), _packages(app.config))


def _packages(config: Any) -> List[str]:
    """This project's packages: ``public_api_packages``, else those of the modules."""
    return list(config.public_api_packages) or sorted(
        {m.split(".")[0] for m in config.public_api_modules})


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def _private_parts(text: str) -> List[Tuple[str, List[str]]]:
    """The dotted names in ``text`` with a private part: (name, its private parts)."""
    found = []
    for name in _NAME.findall(text):
        parts = [part for part in name.split(".") if is_private(part)]
        if parts:
            found.append((name, parts))
    return found


def _owners(module: str, fullname: str) -> List[Any]:
    """The module and the objects along ``fullname`` in it (a method's class), if found."""
    try:
        obj: Any = importlib.import_module(module)
    except Exception:
        return []
    owners = [obj]
    for part in fullname.split(".")[:-1] if fullname else []:
        obj = getattr(obj, part, None)
        if obj is None:
            break
        owners.append(obj)
    if obj is not None and fullname:
        last = getattr(obj, fullname.split(".")[-1], None)
        if inspect.isclass(last):
            owners.append(last)
    return owners


def _own_private(name: str, parts: List[str], owners: Sequence[Any],
                 packages: Sequence[str]) -> bool:
    """Whether a private name in text is this project's: under one of its packages
    (``functional._native``), or an attribute of what the text documents (``_next_plan``)."""
    if name.split(".")[0] in packages:
        return True
    return any(hasattr(owner, part) for owner in owners for part in parts)


def private_names(doctree: nodes.Node, packages: Sequence[str],
                  modules: Sequence[str] = ()) -> List[Tuple[nodes.Node, str]]:
    """Every private name a public API page shows, as (node, what and where).

    Checked: the name, signature (parameters, defaults, annotations) and ``Bases:`` line of
    every documented Python object, whatever the private name's package; in the text
    (inline code and references), the private names of this project: under one of
    ``packages``, or attributes of the object (or module, among ``modules`` for the text
    outside any object) the text documents. Dunders pass.
    """
    found: List[Tuple[nodes.Node, str]] = []
    page_owners: List[Any] = []
    for modname in modules:
        page_owners += _owners(modname, "")

    def text_names(node: nodes.Node, owners: Sequence[Any], where: str) -> None:
        texts = []
        if isinstance(node, (nodes.literal, addnodes.pending_xref)):
            texts.append(node.astext())
        if isinstance(node, (addnodes.pending_xref, nodes.reference)):
            texts.append(node.get("reftarget", "") or "")
        for text in texts:
            for name, parts in _private_parts(text):
                if _own_private(name, parts, owners, packages):
                    found.append((node, f"{name!r} in the text of {where}"))

    def walk(node: nodes.Node, owners: Sequence[Any], where: str) -> None:
        if isinstance(node, addnodes.desc):
            if node.get("domain") == "py":
                check_object(node)
                return
        text_names(node, owners, where)
        for child in node.children if isinstance(node, nodes.Element) else ():
            walk(child, owners, where)

    def check_object(desc: addnodes.desc) -> None:
        owners: List[Any] = []
        title = ""
        for sig in desc.children:
            if not isinstance(sig, addnodes.desc_signature):
                continue
            module, fullname = sig.get("module") or "", sig.get("fullname") or ""
            title = title or ".".join(p for p in (module, fullname) if p) or sig.astext()
            owners = owners or _owners(module, fullname)
            for part in fullname.split("."):
                if is_private(part):
                    found.append((sig, f"{part!r} in the name of {title}"))
            rest = "".join(
                child.astext() for child in sig.children
                if not isinstance(child, (addnodes.desc_name, addnodes.desc_addname))
            )
            for name, _ in _private_parts(rest):
                found.append((sig, f"{name!r} in the signature of {title}"))
        for content in desc.children:
            if not isinstance(content, addnodes.desc_content):
                continue
            for child in content.children:
                if isinstance(child, nodes.paragraph) and child.astext().startswith("Bases:"):
                    # checked whatever the package, once (not again as text)
                    for name, _ in _private_parts(child.astext()[len("Bases:"):]):
                        found.append((child, f"{name!r} in the bases of {title}"))
                else:
                    walk(child, owners, title)

    walk(doctree, page_owners, "the page")
    return found


def _check_private_names(app: Sphinx, doctree: nodes.Node) -> None:
    """``doctree-read``: a private name on a page with a ``public-api`` directive warns."""
    modules = _documented(app.env).get(app.env.docname)
    if not modules:
        return
    for node, what in private_names(doctree, _packages(app.config), sorted(modules)):
        logger.warning(
            f"public-api: private name {what} on a public page: show its public name, or "
            "leave it out (a base, a signature, or this project's private name in the text)",
            location=node,
        )


def setup(app: Sphinx) -> Dict[str, Any]:
    app.add_config_value("public_api_modules", [], "env")
    app.add_config_value("public_api_packages", [], "env")
    app.add_directive("public-api", PublicApiDirective)
    app.connect("builder-inited", _check_packages)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check_coverage)
    app.connect("warn-missing-reference", _only_public_references)
    app.connect("autodoc-process-bases", _process_bases)
    app.connect("doctree-read", _check_private_names)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
