"""The packages' import layering (DESIGN.md): telemetry/ and tools/ import no other project
package (any torch.distributed program can use them alone), and analysis/ never imports
trainer/, importers/ or app/. Read from the source, every import at any depth."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

ALLOWED = {
    "telemetry": {"telemetry"},
    "tools": {"tools"},
    "analysis": {"analysis", "telemetry"},
}
"""Package -> the project packages its modules may import."""


def project_imports(package: str) -> tuple[int, set[tuple[str, str]]]:
    """(modules read, {(module file, imported project package)} for every `ranktrace.X`
    import in `package`)."""
    found = set()
    paths = sorted((REPO / package).rglob("*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "ranktrace" and len(parts) > 1:
                    found.add((str(path.relative_to(REPO)), parts[1]))
    return len(paths), found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    read, imports = project_imports(package)
    assert read > 1, f"{package}/: no modules read"
    wrong = sorted((module, imported) for module, imported in imports
                   if imported not in ALLOWED[package])  # fmt: skip
    assert wrong == [], wrong
