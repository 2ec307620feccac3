"""muloco/testbed/ serves benchmarks and tests: it may import the product, the product never imports it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "muloco"


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, `from a import b` as both a and a.b."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_nothing_in_the_product_imports_the_testbed():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "testbed"):
            continue
        where = path.relative_to(PACKAGE.parent)
        source = path.read_text()
        for line, module in _imported(ast.parse(source)):
            if module == "muloco.testbed" or module.startswith("muloco.testbed."):
                offenders.append(f"{where}:{line}")
        if "muloco.testbed" in source:  # by name: `python -m muloco.testbed...`, importlib
            offenders.append(f"{where}: names muloco.testbed")
    assert not offenders, f"the product imports the testbed (keep what it needs in the product): {offenders}"
