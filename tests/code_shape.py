"""The shape of the source tree, in the figures issue 38 asked for: how long the longest
function in ``distopt/parallel`` is, how often a module reaches into another object's
private attributes, how many distopt classes ``DataParallelOptimizer`` is made of, how many
attributes a live one carries, where private torch names are used, and how many
``duplicates`` pairs ``distopt/`` holds.

``python tests/code_shape.py`` prints the table (about 5 s: the live optimizer needs a
one-rank gloo group). ``tests/test_code_shape.py`` holds the limits CONTRIBUTING states.
Every figure but the live one is read from the source with ``ast``: nothing is imported.
"""
import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from typing import Dict, Iterator, List, NamedTuple, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("distopt", "functional")
#: The two modules allowed to use private torch names (each with its reason).
PRIVATE_API_MODULES = ("distopt/_torch.py", "functional/_torch.py")


def sources(*packages: str) -> List[str]:
    """The ``.py`` files under ``packages`` (default: both), relative to the checkout."""
    out = []
    for package in packages or PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            out += [os.path.relpath(os.path.join(folder, f), ROOT)
                    for f in files if f.endswith(".py")]
    return sorted(out)


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ------------------------------------------------------------------------ function lengths


class Function(NamedTuple):
    where: str  # "path:line qualified.name"
    code_lines: int


def _code_lines(source: str) -> Set[int]:
    """The lines that hold code: not blank, not a comment, not part of a docstring."""
    lines: Set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def functions(*names: str) -> List[Function]:
    """Every function and method in the files ``names``, with its code lines (a nested
    function's lines count in its parent too), longest first."""
    out: List[Function] = []
    for name in names:
        out += functions_in(read(name), name)
    return sorted(out, key=lambda f: -f.code_lines)


def functions_in(source: str, name: str = "<source>") -> List[Function]:
    """``functions`` of one module's ``source``."""
    out = []
    if True:
        code = _code_lines(source)

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = prefix + child.name
                    span = set(range(child.lineno, child.end_lineno + 1))
                    out.append(Function(f"{name}:{child.lineno} {qual}", len(span & code)))
                    visit(child, qual + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(source), "")
    return out


# ------------------------------------------------------- other objects' private attributes


def _imported_names(tree: ast.AST) -> Set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _own_private_names(tree: ast.AST) -> Set[str]:
    """The private names a module defines for its own objects: ``self._x = ...`` (or
    ``cls._x``), methods and class attributes of its classes."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if is_private(n)}


def foreign_private_accesses(name: str, own_module_too: bool = True) -> List[str]:
    """``"path:line obj._attr"`` for each private attribute read or written on an object
    that is not ``self``/``cls`` (nor a module: ``_torch.x`` is a module's public name; nor
    a NamedTuple's ``_replace``). The ``_torch`` modules, whose job it is, count nothing.
    ``own_module_too=False``: only attributes this module does not define for its own
    classes (``other._x`` where ``other`` is an instance of a class of this module is the
    class's own business)."""
    if name in PRIVATE_API_MODULES:
        return []
    return foreign_private_accesses_in(read(name), name, own_module_too)


def foreign_private_accesses_in(source: str, name: str = "<source>",
                                own_module_too: bool = True) -> List[str]:
    """``foreign_private_accesses`` of one module's ``source``."""
    tree = ast.parse(source)
    modules = _imported_names(tree)
    own = set() if own_module_too else _own_private_names(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)) \
                or node.attr in ("_replace", "_asdict", "_fields", "_make") or node.attr in own:
            continue
        value = node.value
        if isinstance(value, ast.Name) and (value.id in ("self", "cls") or value.id in modules):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id == "super":
            continue
        out.append(f"{name}:{node.lineno} {ast.unparse(value)}.{node.attr}")
    return out


# ------------------------------------------------------------------- private torch names


def _defined_names(names: List[str]) -> Set[str]:
    """Every private name the project's own source defines: functions, classes, class
    attributes, attributes it assigns (``x._a = ...``), module-level names, imports."""
    defined: Set[str] = set()
    for name in names:
        for node in ast.walk(ast.parse(read(name))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined.add(node.attr)  # (``opt._x = ...`` on another object defines nothing)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    if not (isinstance(node, ast.ImportFrom)
                            and (node.module or "").split(".")[0] == "torch"):
                        defined.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant):
                defined.add(str(node.args[1].value))
    return {d for d in defined if is_private(d)}


def _chain(node: ast.AST) -> List[str]:
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    return [node.id] + parts[::-1]


#: Private names of torch's that may be used anywhere: torch.optim's own kernels
#: (``torch._foreach_*``, ``torch._fused_*``), called by name from TorchScript functions,
#: where no Python wrapper can be called; and the sparse tensor accessors TorchScript
#: functions read as torch.optim's sparse code does (``_values``, ``_indices``).
#: ``_step_supports_amp_scaling`` is a name an optimizer declares for GradScaler, not a use;
#: ``_replace``, ``_asdict``, ``_fields`` and ``_make`` are a NamedTuple's public methods.
ANYWHERE = re.compile(r"_(foreach|fused)_\w*|_values|_indices|_nnz|_step_supports_amp_scaling"
                      r"|_replace|_asdict|_fields|_make")


def private_torch_names(source: str, ours: Set[str]) -> List[str]:
    """``"line: what"`` for each private torch name ``source`` uses: a private name
    reached from a torch module (``torch._C``, ``dist._x``, ``import torch._jit_internal``,
    ``getattr(torch._C, "_x")``), a private name mentioned in a comment or docstring as
    reached from torch (``torch.profiler._ExperimentalConfig``), and any private attribute
    (``opt._join_config``, ``p._base``) or ``getattr`` name that the project's own source
    (``ours``) never defines: a private name nobody here defined is someone else's."""
    tree = ast.parse(source)
    torch_names: Dict[str, str] = {}
    found: List[Tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if any(is_private(p) for p in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
                    torch_names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                where = f"{node.module}.{a.name}"
                if any(is_private(p) for p in where.split(".")):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                torch_names[a.asname or a.name] = where
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _chain(node)
            if parts and parts[0] in torch_names:
                if id(node) in inner:
                    continue  # a chain from torch is checked once, whole
                private = [p for p in parts[1:] if is_private(p)]
                if private and not (len(parts) == 2 and ANYWHERE.fullmatch(parts[1])):
                    found.append((node.lineno, ".".join(parts)))
            elif is_private(node.attr) and node.attr not in ours \
                    and not ANYWHERE.fullmatch(node.attr):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            attr = node.args[1].value
            target = _chain(node.args[0])
            if is_private(attr) and (attr not in ours or (target and target[0] in torch_names)):
                found.append((node.lineno, f"{node.func.id}(..., {attr!r})"))
    # Prose: "torch.x._y" in a comment or docstring is a private name the code leans on.
    for number, line in enumerate(source.splitlines(), 1):
        for m in re.finditer(r"\btorch(?:\.\w+)*\.(_[A-Za-z]\w*)", line):
            if not ANYWHERE.fullmatch(m.group(1)):
                found.append((number, m.group(0)))
    return [f"{line}: {what}" for line, what in sorted(set(found))]


def our_private_names() -> Set[str]:
    """Every private name the project's source defines for itself (``_defined_names``)."""
    return _defined_names(sources())


def private_torch_uses() -> Dict[str, List[str]]:
    """File -> its private torch names, for every file outside the two ``_torch`` modules."""
    names = sources()
    ours = _defined_names(names)
    out = {}
    for name in names:
        if name in PRIVATE_API_MODULES:
            continue
        uses = private_torch_names(read(name), ours)
        if uses:
            out[name] = uses
    return out


# ------------------------------------------------------------------------- the live figures


def live_figures() -> Tuple[int, int, List[str]]:
    """A DataParallelOptimizer after one step on a one-rank gloo group: the distopt classes
    in its MRO, its instance attributes, and their names."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from distopt.parallel import DataParallelOptimizer
    from tests.worlds import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = DataParallelOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mro = [c for c in type(opt).__mro__ if c.__module__.split(".")[0] == "distopt"]
        attrs = sorted(vars(opt))
        opt.close()
        return len(mro), len(attrs), attrs
    finally:
        dist.destroy_process_group()


def duplicate_pairs(folder: str = "distopt") -> str:
    """``duplicates``' first line over ``folder`` (its pair count), or why it is missing."""
    if shutil.which("duplicates") is None:
        return "duplicates not installed"
    out = subprocess.run(["duplicates", "--repo", os.path.join(ROOT, folder), "--most", "1"],
                         capture_output=True, text=True, timeout=120).stdout
    return out.splitlines()[0] if out else "no output"


def main() -> None:
    parallel = functions(*sources("distopt/parallel"))
    accesses = [a for name in sources("distopt") for a in foreign_private_accesses(name)]
    across = [a for name in sources("distopt")
              for a in foreign_private_accesses(name, own_module_too=False)]
    torch_uses = private_torch_uses()
    print("measuring a live DataParallelOptimizer (one rank, gloo) ...", flush=True)
    mro, attrs, names = live_figures()
    print("| figure | value |\n|---|---|")
    print(f"| longest function in distopt/parallel (code lines) | {parallel[0].code_lines} "
          f"({parallel[0].where}) |")
    over = [f for f in parallel if f.code_lines > 60]
    print(f"| functions in distopt/parallel over 60 code lines | {len(over)} |")
    print(f"| accesses to another object's private attributes in distopt/ | {len(accesses)} |")
    print(f"| ... of attributes another module defines | {len(across)} |")
    print(f"| distopt classes in DataParallelOptimizer's MRO | {mro} |")
    print(f"| instance attributes of a live DataParallelOptimizer | {attrs} |")
    print(f"| modules using private torch names outside the _torch modules | "
          f"{len(torch_uses)} ({', '.join(sorted(torch_uses))}) |")
    print(f"| duplicates in distopt/ | {duplicate_pairs()} |")
    if "-v" in sys.argv:
        print("\nfunctions over 60 code lines:", *over, sep="\n  ")
        print("\nprivate accesses:", *accesses, sep="\n  ")
        print("\nprivate torch names:", *(f"{k}: {v}" for k, v in torch_uses.items()),
              sep="\n  ")
        print("\nattributes:", ", ".join(names))


if __name__ == "__main__":
    main()
