"""House rules of the layout: the engine never imports a tool, the wheel never imports the workshop (dev/),
and no module reaches into another's private names.

The engine is every module of hf_contextpar/ (api, runtime, plan, attention/, ...) and the family
patches, apart from hf_contextpar/tools/ (the command line, benchmark, self-test, prediction,
calibration, built-in models, simulated ranks), the `python -m hf_contextpar.bench` entry point
(hf_contextpar/bench.py) and `python -m hf_contextpar` (__main__.py). The tools and the eval
harness use the engine's public names; the engine imports neither them nor the harness. The server
(hf_contextpar/tools/serve/) is one of the tools: it drives the engine through its public names. And no module of the
installed package (hf_contextpar/, patches/, eval/) runs over 600 lines: a size at which a module is reviewed,
not one to split by line count.

No import circles: not between files, and not between the rooms of any folder (a folder's rooms are
its files and its subfolders, each subfolder one room, as `farm-studio look` draws them), with
patches/ and eval/ read as the hf_contextpar.patches and hf_contextpar.eval they install as. A
package's own __init__ running first is Python's business, not an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

from areas import ROOT  # the repository root

# directory -> the package it installs as (pyproject's package-dir)
PACKAGES = {"hf_contextpar": "hf_contextpar", "eval": "hf_contextpar.eval", "patches": "hf_contextpar.patches"}
# what the engine must not import: the tools, the eval harness, the bench entry point
FORBIDDEN = ("hf_contextpar.tools", "hf_contextpar.eval", "eval", "hf_contextpar.bench")
MAX_LINES = 600
NOT_ENGINE = (
    "hf_contextpar.tools",
    "hf_contextpar.bench",
    "hf_contextpar.__main__",
    "hf_contextpar.eval",
)


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


# the workshop (dev/: the census, the benchmarks page) and the tests run from a checkout; the wheel lacks them
WORKSHOP = ("dev", "tests")


def wheel_violations(root: Path = ROOT) -> list[str]:
    """Imports of the workshop from anything the wheel installs: it would fail on every user's machine."""
    bad = []
    for name, init, path in modules(root):
        for line, module, _ in imports(name, init, ast.parse(path.read_text())):
            if any(_within(module, w) for w in WORKSHOP):
                bad.append(f"{path.relative_to(root)}:{line}: the wheel imports {module}, which it does not carry")
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`from pkg import sub` names the submodule, not pkg)."""
    ours = {name: init for name, init, _ in modules(root)}
    graph = {name: set() for name in ours}
    for name, init, path in modules(root):
        for _, module, names in imports(name, init, ast.parse(path.read_text())):
            subs = [f"{module}.{n}" for n in names or () if f"{module}.{n}" in ours]
            targets = subs if subs and len(subs) == len(names or ()) else [module, *subs]
            graph[name] |= {t for t in targets if t in ours and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path(name: str, init: bool) -> list[str]:
    """A module's place in the tree: its folders, then its file (a package's face is its __init__)."""
    parts = name.split(".")
    return [*parts, "__init__"] if init else parts


def circles(root: Path = ROOT) -> list[str]:
    """Every import circle between files, and between the rooms of each folder."""
    graph, inits = import_graph(root), {name: init for name, init, _ in modules(root)}
    found = [" -> ".join(c) for c in _cycles(graph)]
    rooms: dict[tuple, dict[str, set[str]]] = {}  # folder -> room -> rooms it imports
    for a, targets in graph.items():
        pa = _path(a, inits[a])
        for b in targets:
            pb = _path(b, inits[b])
            common = 0
            while pa[common] == pb[common]:
                common += 1
            folder = tuple(pa[:common])
            rooms.setdefault(folder, {}).setdefault(pa[common], set()).add(pb[common])
    for folder, graph_of_rooms in sorted(rooms.items()):
        found += [f"in {'/'.join(folder)}/: " + " -> ".join(c) for c in _cycles(graph_of_rooms)]
    return found


def test_no_import_circles():
    assert not circles(), "import circles:\n" + "\n".join(circles())


def test_every_package_is_in_the_wheel():
    """pyproject lists the packages by name: a new folder missing there would be left out of the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, init, _ in modules() if init}
    assert found <= listed, f"add to pyproject.toml's packages: {sorted(found - listed)}"


def algorithm_reads(root: Path = ROOT) -> dict[str, set[str]]:
    """Per algorithm file of the registry (plan/strategies.py, files in hf_contextpar/attention/): the names
    it reads of its `step`."""
    from hf_contextpar.plan.strategies import STRATEGIES

    reads = {}
    for strategy in STRATEGIES.values():
        module = (strategy.algorithm or f".{strategy.name}:{strategy.name}").partition(":")[0]
        if not module.startswith("."):
            continue  # a test's own
        path = root / "hf_contextpar" / "attention" / f"{module[1:]}.py"
        tree = ast.parse(path.read_text())
        reads[path.name] = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "step"
        }
    return reads


def test_algorithms_read_only_their_layer_call():
    """An algorithm reads of its step what `attention.call.LayerCall` lists: it returns (out, LSE) and hands
    received blocks over; the plan, the cache and the adapter's bookkeeping are not its to touch."""
    from hf_contextpar.attention.call import MEMBERS

    assert len(algorithm_reads()) >= 8
    beyond = {name: sorted(names - MEMBERS) for name, names in algorithm_reads().items() if names - MEMBERS}
    assert not beyond, f"algorithms reading beyond LayerCall: {beyond}"


def test_engine_imports_no_tool():
    assert not engine_violations(), "\n".join(engine_violations())


def test_the_wheel_imports_no_workshop():
    assert not wheel_violations(), "\n".join(wheel_violations())


def test_no_private_names_across_modules():
    assert not private_violations(), "\n".join(private_violations())


def test_no_module_over_600_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for _, _, path in modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"review these by concept (at most {MAX_LINES} lines a module): " + ", ".join(long)


MAX_FUNCTION_LINES = 60


def long_functions(root: Path = ROOT) -> list[str]:
    """Engine functions over MAX_FUNCTION_LINES lines of code (the docstring aside): the tools apart."""
    long = []
    for name, _, path in modules(root):
        if any(_within(name, p) for p in NOT_ENGINE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = node.body[0] if ast.get_docstring(node) is not None else None
                lines = node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return long


def test_engine_functions_are_short():
    assert not long_functions(), f"split into named phases (at most {MAX_FUNCTION_LINES} lines): " + ", ".join(
        long_functions()
    )


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
    (tmp_path / "hf_contextpar" / "api.py").write_text(
        'def f():\n    """doc"""\n    from .eval import compare\n' + "    x = 1\n" * (MAX_FUNCTION_LINES - 2)
    )
    engine = engine_violations(tmp_path)
    assert any("runtime.py:1" in b and "hf_contextpar.tools" in b for b in engine), engine
    assert any("api.py:3" in b and "hf_contextpar.eval" in b for b in engine), engine
    assert long_functions(tmp_path) == [], long_functions(tmp_path)  # 60 lines of code besides the docstring
    (tmp_path / "hf_contextpar" / "api.py").write_text(
        (tmp_path / "hf_contextpar" / "api.py").read_text() + "    x = 2\n"
    )
    assert [b.split(":")[0] for b in long_functions(tmp_path)] == ["hf_contextpar/api.py"], long_functions(tmp_path)
    assert any("patches/__init__.py:1" in b for b in engine), engine
    assert wheel_violations(tmp_path) == []
    (tmp_path / "hf_contextpar" / "tools" / "census.py").write_text("from dev.census.configs import scope\n")
    assert [b.split(":")[0] for b in wheel_violations(tmp_path)] == ["hf_contextpar/tools/census.py"]
    (tmp_path / "hf_contextpar" / "tools" / "cli.py").write_text("from ..eval import compare\n")
    (tmp_path / "eval" / "compare.py").write_text("from hf_contextpar.tools import models\n")
    (tmp_path / "hf_contextpar" / "plan").mkdir()
    (tmp_path / "hf_contextpar" / "plan" / "__init__.py").write_text("")
    (tmp_path / "hf_contextpar" / "plan" / "forward.py").write_text("from ..runtime import x\n")
    found = circles(tmp_path)
    assert (
        "hf_contextpar.eval.compare -> hf_contextpar.tools.cli" not in found
    )  # no file circle: cli -> compare -> models
    assert "in hf_contextpar/: eval -> tools" in found, found  # but eval/ and tools/ import each other
    assert "in hf_contextpar/: plan -> runtime" not in found  # runtime.py imports kernels.py only
    (tmp_path / "hf_contextpar" / "kernels.py").write_text("from .plan import forward\ndef _math(): ...\n")
    found = circles(tmp_path)
    assert "hf_contextpar.kernels -> hf_contextpar.plan.forward -> hf_contextpar.runtime" in found, found
    assert "in hf_contextpar/: kernels -> plan -> runtime" in found, found
    private = private_violations(tmp_path)
    assert any("patches/__init__.py:1" in b and "_helper" in b for b in private), private
    assert any("runtime.py:3" in b and "kernels._math" in b for b in private), private
