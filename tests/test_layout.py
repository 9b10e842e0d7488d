"""anvil_fast's layout: layer packages, each importing only its own and the layers below it.

The layers are data (``anvil_fast.LAYERS``, bottom first); this file reads every module's imports
(top-level and deferred, relative and absolute) from its source, without importing it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import anvil_fast

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "anvil_fast"
#: The layers a library module may stand in: everything below the benchmarks and the studies.
LIBRARY = ("kernels", "core", "parallel", "optim", "models")
#: Modules outside every layer: the package's facades (the front door, and the public testing API
#: over the studies), which no library module imports.
FACADES = ("anvil_fast", "anvil_fast.testing")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in FAST.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The anvil_fast modules ``path`` imports: ``from pkg import name`` counts as ``pkg.name`` when
    that is a module, as ``pkg`` otherwise."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            out |= set(subs) if subs else {target}
    return {m for m in out if m == "anvil_fast" or m.startswith("anvil_fast.")}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in anvil_fast.LAYERS) else None


def test_the_layers_are_packages_holding_every_module():
    assert len(anvil_fast.LAYERS) <= 8
    assert {p.name for p in FAST.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(anvil_fast.LAYERS)
    loose = [m for m in modules() if layer_of(m) is None and m not in FACADES]
    assert not loose, f"modules outside every layer package: {loose}"


def test_no_module_imports_a_layer_above_its_own():
    known = set(modules())
    rank = {name: i for i, name in enumerate(anvil_fast.LAYERS)}
    upward = []
    for mod, path in modules().items():
        own = layer_of(mod)
        if own is None:
            continue
        for dep in imports_of(path, known):
            if dep in FACADES:
                if own in LIBRARY:
                    upward.append(f"{mod} -> {dep} (a facade, which imports the layers above)")
                continue
            if rank[layer_of(dep)] > rank[own]:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself can fail: a kernel module that imports a study is reported."""
    fake = tmp_path / "anvil_fast" / "kernels"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("def f():\n    from ..studies import difftest\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    got = imports_of(fake / "x.py", {"anvil_fast.studies.difftest"})
    assert got == {"anvil_fast.studies.difftest"}
    assert layer_of("anvil_fast.studies.difftest") == "studies"


def test_the_testing_facade_offers_the_harness_and_imports_only_the_studies():
    import anvil_fast.testing as testing
    from anvil_fast.studies import harness

    assert testing.assert_orthogonalizer is harness.assert_orthogonalizer
    assert testing.DEFAULT_FAMILIES == harness.DEFAULT_FAMILIES
    deps = imports_of(FAST / "testing.py", set(modules()))
    assert deps and all(layer_of(d) == "studies" for d in deps), deps


def test_library_layers_hold_no_command_line():
    """Every ``python -m`` entry lives in the top layers (bench, studies)."""
    mains = [m for m, p in modules().items() if layer_of(m) in LIBRARY and "__main__" in p.read_text()
             and ('if __name__ == "__main__"' in p.read_text() or p.name == "__main__.py")]
    assert not mains, f"command lines in library layers: {mains}"


def test_the_module_map_lists_every_module_with_its_package():
    doc = anvil_fast.__doc__
    listed = {m for m in modules() if layer_of(m) and m.count(".") == 2 and not m.endswith("__main__")}
    missing = [m for m in sorted(listed) if f"``{m.split('.', 1)[1]}``" not in doc]
    assert not missing, f"anvil_fast/__init__.py's module map lacks {missing}"
    stale = [w.strip("`") for w in doc.split() if w.startswith("``") and w.endswith("``") and "." in w
             and w.strip("`").split(".")[0] in anvil_fast.LAYERS and f"anvil_fast.{w.strip('`')}" not in listed]
    assert not stale, f"the module map names modules that do not exist: {stale}"


@pytest.mark.parametrize("layer", ["kernels", "core", "parallel", "optim", "models", "bench", "studies"])
def test_every_layer_says_what_it_holds(layer):
    doc = ast.get_docstring(ast.parse((FAST / layer / "__init__.py").read_text()))
    assert doc and doc.startswith(f"anvil_fast.{layer}:"), layer


def test_the_facade_offers_every_layer_and_its_lazy_names():
    assert set(anvil_fast.LAYERS) <= set(dir(anvil_fast))
    for layer in anvil_fast.LAYERS:
        assert getattr(anvil_fast, layer).__name__ == f"anvil_fast.{layer}"
    assert anvil_fast.ANVIL.__module__ == "anvil_fast.optim.entry"
