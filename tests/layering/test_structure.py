"""The shape of the code, read with `ast`: the limits issue 60 set, so that they hold after it.

- No function in `src/` longer than 80 lines: one that needs a table of contents wants splitting.
- No class in `bench/` or `testbed/` with more than 12 attributes (its own `self.x = ...` and annotated fields):
  a bag of flags or a god object wants parts.
- String-literal subscripts (`row["mode"]`) in `bench/` stay within the budget: rows and replies are read through
  typed views (`kvprefetch.results`), not string-keyed dicts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvprefetch

ROOT = Path(kvprefetch.__file__).resolve().parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_ATTRIBUTES = 12
MAX_BENCH_STRING_SUBSCRIPTS = 188  # 460 before issue 60


def _trees(folder: Path) -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in sorted(folder.rglob("*.py"))}


def _attributes(cls: ast.ClassDef) -> set[str]:
    own = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
           and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return own | fields


def test_no_function_is_longer_than_80_lines():
    long = [f"{p.relative_to(ROOT)}:{f.name} ({f.end_lineno - f.lineno + 1})"
            for p, tree in _trees(ROOT).items() for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]  # fmt: skip
    assert long == []


def test_no_bench_or_testbed_class_has_more_than_12_attributes():
    big = [f"{p.relative_to(ROOT)}:{c.name} ({len(_attributes(c))})"
           for folder in ("bench", "testbed") for p, tree in _trees(ROOT / folder).items()
           for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and len(_attributes(c)) > MAX_CLASS_ATTRIBUTES]
    assert big == []


def test_the_bench_reads_few_rows_by_string_keys():
    count = sum(1 for tree in _trees(ROOT / "bench").values() for n in ast.walk(tree)
                if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
                and isinstance(n.slice.value, str))  # fmt: skip
    assert count <= MAX_BENCH_STRING_SUBSCRIPTS, count


def test_the_attribute_count_sees_fields_and_assignments():
    """The check counts what it claims to (a class of 13 is caught)."""
    src = "class C:\n" + "".join(f"    a{i}: int\n" for i in range(7)) + (
        "    def __init__(self):\n" + "".join(f"        self.b{i} = 0\n" for i in range(6)))
    cls = ast.parse(src).body[0]
    assert isinstance(cls, ast.ClassDef) and len(_attributes(cls)) == 13
