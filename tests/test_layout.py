"""House rules of the layout: the engine never imports a tool, and no module reaches into another's private names.

The engine is every module of hf_contextpar/ (api, runtime, plan, attention/, ...) and the family
patches, apart from hf_contextpar/tools/ (the command line, benchmark, self-test, prediction,
calibration, built-in models, simulated ranks), the `python -m hf_contextpar.bench` entry point
(hf_contextpar/bench.py) and `python -m hf_contextpar` (__main__.py). The tools and the eval
harness use the engine's public names; the engine imports neither them nor the harness. And no
module of hf_contextpar/ runs over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# directory -> the package it installs as (pyproject's package-dir)
PACKAGES = {"hf_contextpar": "hf_contextpar", "eval": "hf_contextpar.eval", "patches": "hf_contextpar.patches"}
# what the engine must not import: the tools, the eval harness, the bench entry point
FORBIDDEN = ("hf_contextpar.tools", "hf_contextpar.eval", "eval", "hf_contextpar.bench")
MAX_LINES = 400
NOT_ENGINE = ("hf_contextpar.tools", "hf_contextpar.bench", "hf_contextpar.__main__", "hf_contextpar.eval")


def modules(root: Path = ROOT):
    """(module name, is a package's __init__, path) of every Python module of the library under root."""
    for directory, package in PACKAGES.items():
        for path in sorted((root / directory).rglob("*.py")):
            parts = path.relative_to(root / directory).with_suffix("").parts
            init = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if init else parts)))
            yield name, init, path


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(name: str, init: bool, tree: ast.AST):
    """(line, imported module, imported names or None) for each import in tree, relative imports resolved."""
    package = name if init else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield node.lineno, base, [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, None


def engine_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for name, init, path in modules(root):
        if any(_within(name, p) for p in NOT_ENGINE):
            continue
        for line, module, names in imports(name, init, ast.parse(path.read_text())):
            targets = [module] + [f"{module}.{n}" for n in names or ()]
            hit = [t for t in targets if any(_within(t, f) for f in FORBIDDEN)]
            if hit:
                bad.append(f"{path.relative_to(root)}:{line}: the engine imports {hit[0]}")
    return bad


def private_violations(root: Path = ROOT) -> list[str]:
    """Imports of an underscore name from another of our modules, and module._name uses of one."""
    ours = {name for name, _, _ in modules(root)}
    bad = []
    for name, init, path in modules(root):
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> one of our modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in ours or alias.name == "hf_contextpar":
                        aliases[alias.asname or alias.name] = alias.name
        for line, module, names in imports(name, init, tree):
            if names is None or not _within(module, "hf_contextpar"):
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{path.relative_to(root)}:{line}: imports the private {module}.{n}")
                elif f"{module}.{n}" in ours:
                    aliases[n] = f"{module}.{n}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(
                    f"{path.relative_to(root)}:{node.lineno}: uses the private {aliases[node.value.id]}.{node.attr}"
                )
    return bad


def test_engine_imports_no_tool():
    assert not engine_violations(), "\n".join(engine_violations())


def test_no_private_names_across_modules():
    assert not private_violations(), "\n".join(private_violations())


def test_no_module_over_400_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted((ROOT / "hf_contextpar").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"split these by job (at most {MAX_LINES} lines a module): " + ", ".join(long)


def test_rules_catch_violations(tmp_path):
    """The checks above can fail: a copy of the layout with one violation of each kind."""
    (tmp_path / "hf_contextpar" / "tools").mkdir(parents=True)
    (tmp_path / "eval").mkdir()
    (tmp_path / "patches").mkdir()
    (tmp_path / "hf_contextpar" / "__init__.py").write_text("")
    (tmp_path / "hf_contextpar" / "tools" / "__init__.py").write_text("")
    (tmp_path / "hf_contextpar" / "tools" / "models.py").write_text("def _helper(): ...\n")
    (tmp_path / "hf_contextpar" / "kernels.py").write_text("def _math(): ...\n")
    (tmp_path / "eval" / "__init__.py").write_text("")
    (tmp_path / "patches" / "__init__.py").write_text("from hf_contextpar.tools.models import _helper\n")
    (tmp_path / "hf_contextpar" / "runtime.py").write_text(
        "from .tools import models\nfrom . import kernels\nkernels._math()\n"
    )
    (tmp_path / "hf_contextpar" / "api.py").write_text("def f():\n    from .eval import compare\n")
    engine = engine_violations(tmp_path)
    assert any("runtime.py:1" in b and "hf_contextpar.tools" in b for b in engine), engine
    assert any("api.py:2" in b and "hf_contextpar.eval" in b for b in engine), engine
    assert any("patches/__init__.py:1" in b for b in engine), engine
    private = private_violations(tmp_path)
    assert any("patches/__init__.py:1" in b and "_helper" in b for b in private), private
    assert any("runtime.py:3" in b and "kernels._math" in b for b in private), private
