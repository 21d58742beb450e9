"""The parity table: every ``cases_*.py`` module's CASES, gathered."""
import importlib
import pathlib

ALL_CASES = []
for _path in sorted(pathlib.Path(__file__).parent.glob("cases_*.py")):
    ALL_CASES.extend(importlib.import_module(f"{__package__}.{_path.stem}").CASES)
