"""The package's layering, checked from its own imports (STYLE 10, docs/architecture.md).

Every ``import`` of ``src/ops_transformer`` — module- and function-level, as ``ast`` sees them —
is an arrow between two units (a subpackage, a top-level module, or the package's ``__init__``).
The floors are the ``layering`` block of docs/architecture.md: no arrow may run to a higher floor,
no two units may import each other (directly or round a cycle), at most one cycle may join files,
and ``parallelize()`` stays at most 60 lines. Pure logic: no process group."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ops_transformer"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    """Dotted module name → file (``ops_transformer.comm`` for ``comm/__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules that ``name`` imports (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parent = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
                module = parent + ("." + node.module if node.module else "")
            else:
                module = node.module or ""
            for alias in node.names:
                if f"{module}.{alias.name}" in MODULES:
                    found.add(f"{module}.{alias.name}")
                elif module in MODULES:
                    found.add(module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
    return found - {name}


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _unit(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "<root>"
    return parts[1]  # a subpackage or a top-level module (train, data, _version, __main__)


def _floors() -> dict[str, int]:
    block = re.search(r"```layering\n(.*?)```", ARCHITECTURE.read_text(), flags=re.S)
    assert block, "docs/architecture.md has no ```layering block"
    return {unit: floor for floor, line in enumerate(block.group(1).strip().splitlines())
            for unit in line.split()}  # floor 0 is the top


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_floor():
    floors = _floors()
    missing = sorted({_unit(m) for m in MODULES} - set(floors))
    assert not missing, f"place {missing} in the layering block of docs/architecture.md"


def test_no_import_runs_to_a_higher_floor():
    floors = _floors()
    upward = [f"{src} (floor {floors[_unit(src)]}) imports {dst} (floor {floors[_unit(dst)]})"
              for src, targets in IMPORTS.items() for dst in sorted(targets)
              if floors[_unit(dst)] < floors[_unit(src)]]
    assert not upward, "\n".join(upward)


def test_no_cycle_between_packages_and_at_most_one_between_files():
    units = defaultdict(set)
    for src, targets in IMPORTS.items():
        units[_unit(src)] |= {_unit(t) for t in targets if _unit(t) != _unit(src)}
    assert _cycles(dict(units)) == []
    # between files: a package's __init__ aggregates its modules, it is not one of them
    files = {m: {t for t in ts if MODULES[t].name != "__init__.py"}
             for m, ts in IMPORTS.items() if MODULES[m].name != "__init__.py"}
    assert len(_cycles(files)) <= 1, _cycles(files)


def test_parallelize_is_short_and_plans_hold_no_lambda_and_register_no_hook():
    tree = ast.parse((PACKAGE / "parallelize" / "__init__.py").read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name == "parallelize")
    assert function.end_lineno - function.lineno + 1 <= 60
    for path in (PACKAGE / "parallelize").glob("*.py"):
        source = path.read_text()
        if path.name in ("styles.py", "plan.py", "sequence_plan.py", "gpt_plan.py",
                         "hf_plans.py"):
            lambdas = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Lambda)]
            assert not lambdas, f"{path.name}: lambda at lines {lambdas}"
        assert "register_forward" not in source, f"{path.name} registers a hook"


def test_every_style_is_a_named_function_of_the_styles_module():
    from ops_transformer.parallelize import styles

    for name, style in styles.STYLES.items():
        assert style.__name__ == name and style.__module__ == styles.__name__


@pytest.mark.parametrize("rule, needle", [
    ({"style": "colwise", "gather_outputs": True}, r"option\(s\) \['gather_outputs'\]"),
    ({"style": "mla_kv_a"}, r"needs option\(s\) \['rope_dim'\]"),
    ({"style": "columnwise"}, r"style 'columnwise'; valid styles"),
])
def test_a_rule_is_checked_against_its_style_when_the_plan_is_built(rule, needle):
    from ops_transformer import Plan

    with pytest.raises(ValueError, match=needle):
        Plan(rules={"layers.*.attn.wq": rule})
