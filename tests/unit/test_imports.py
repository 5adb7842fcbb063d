"""The package's import graph: no cycle, planners apart from launchers, planners without CuPy.

The graph is read from the source (every ``import`` / ``from`` statement, including those inside
functions), so an import hidden in a function body counts like one at the top.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cupyflash"

#: Modules that run without CuPy: the planners and everything under them (docs/architecture.md).
PURE = ("cupyflash.gpu.params", "cupyflash.gpu.tma", "cupyflash.gpu.variants",
        "cupyflash.gpu.tuning", "cupyflash.gpu.compile", "cupyflash.gpu.plan_fwd",
        "cupyflash.gpu.plan_fwd_sm90", "cupyflash.gpu.plan_bwd", "cupyflash.gpu.plan_bwd_sm90",
        "cupyflash.gpu.plan_bwd_sm90_f32", "cupyflash.gpu.plan_dbias_sm90")


def _modules():
    """{module name: path} of every module under cupyflash/."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph():
    """{module: sorted cupyflash modules it imports} (``from pkg import name`` counts as an
    import of pkg.name where that is a module, else of pkg)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    root = base[:len(base) - (node.level - 1)]
                    src = ".".join(root + ([node.module] if node.module else []))
                else:
                    src = node.module
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = sorted(deps)
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(n, stack):
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m, stack)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n, [])
            if found:
                return found
    return None


def test_graph_reads_imports_inside_functions(tmp_path, monkeypatch):
    """The walker sees an import in a function body (such imports once hid a cycle)."""
    pkg = tmp_path / "cupyflash"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    graph = import_graph()
    assert graph["cupyflash.a"] == ["cupyflash.b"] and graph["cupyflash.b"] == ["cupyflash.a"]
    assert _cycle(graph) is not None


def test_no_import_cycle():
    graph = import_graph()
    print("\n" + "\n".join(f"{m} -> {', '.join(d) or '(none)'}" for m, d in graph.items()))
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_planners_import_no_launcher():
    """The pure modules import only pure modules (the planners never reach a launcher)."""
    graph = import_graph()
    bad = {m: [d for d in graph[m] if d not in PURE] for m in PURE}
    assert not any(bad.values()), bad


def test_planners_import_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None; "
            + "; ".join(f"import {m}" for m in PURE)
            + "; assert not any(k == 'cupy' or k.startswith('cupy.') for k, v in sys.modules.items() "
              "if v is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PKG.parent, timeout=120)
    assert done.returncode == 0, done.stderr
