"""The layers point one way: the core (src/domainfm) imports no family code (finetune, pretrain,
data_loaders) and only the CLI imports the CLI; families declare predict/embed on the apply
layer instead of parsing arguments themselves."""
from __future__ import annotations

import ast
from pathlib import Path

import domainfm

CORE = Path(domainfm.__file__).parent
FAMILY_PACKAGES = ("domainfm.finetune", "domainfm.pretrain", "domainfm.data_loaders")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_the_core_imports_no_family_code_and_only_the_cli_imports_the_cli():
    bad = []
    for path in sorted(CORE.rglob("*.py")):
        for name in _imports(path):
            if name.startswith(FAMILY_PACKAGES) or (name.startswith("domainfm.cli") and path.name != "cli.py"):
                bad.append(f"{path.relative_to(CORE)}: {name}")
    assert not bad, bad
    assert len(list(CORE.rglob("*.py"))) > 20  # the walk saw the core


def test_families_declare_predict_and_embed_without_argparse():
    import domainfm.finetune as finetune

    families = sorted(p for p in Path(finetune.__path__[0]).glob("*.py") if p.name != "__init__.py")
    assert len(families) == 8
    for path in families:
        assert "argparse" not in _imports(path), path.name
        assert "APPLY" in path.read_text(), path.name
