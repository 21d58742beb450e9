"""The shape CONTRIBUTING promises for the data-parallel engine, checked on the source
(``tests/code_shape.py``): short functions, no module reaching into another's objects, and
``DataParallelOptimizer`` one class that holds its engine."""
from tests import code_shape

#: The most code lines (no blank, comment or docstring lines) of a function in
#: distopt/parallel.
LONGEST = 60


def test_no_function_in_distopt_parallel_is_over_60_code_lines():
    over = [f for f in code_shape.functions(*code_shape.sources("distopt/parallel"))
            if f.code_lines > LONGEST]
    assert over == [], f"split these (at most {LONGEST} code lines each): {over}"


def test_no_module_of_distopt_reads_or_writes_private_attributes_another_module_defines():
    found = [a for name in code_shape.sources("distopt")
             for a in code_shape.foreign_private_accesses(name, own_module_too=False)]
    assert found == [], (
        "a module reaches into an object of another module's class (give that class a "
        f"method or a public attribute for it): {found}")


def test_the_checks_find_what_they_look_for():
    """Planted: a function one line too long, and a private attribute of another module's
    object beside one of this module's own class."""
    body = "\n".join(f"    x{k} = {k}" for k in range(LONGEST))
    source = f'def f():\n    """Doc."""\n    # a comment\n\n{body}\n'
    (f,) = code_shape.functions_in(source)
    assert f.code_lines == LONGEST + 1  # the def line and the assignments only
    source = ("class A:\n    def __init__(self):\n        self._mine = 1\n\n\n"
              "def g(a, b):\n    return a._mine + b._theirs\n")
    assert code_shape.foreign_private_accesses_in(source, "m.py", own_module_too=False) == [
        "m.py:7 b._theirs"]
    assert len(code_shape.foreign_private_accesses_in(source, "m.py")) == 2


def test_data_parallel_optimizer_is_one_distopt_class_holding_its_engine():
    from distopt.parallel import DataParallelOptimizer

    ours = [c for c in DataParallelOptimizer.__mro__ if c.__module__.split(".")[0] == "distopt"]
    assert ours == [DataParallelOptimizer]
