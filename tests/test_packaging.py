"""Packaging invariants: the README's quick start, CI running it, no JAX, anvil_ref standing alone."""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.strip()]


def test_readme_quick_start_has_exactly_two_command_lines():
    cmds = quick_start_commands()
    assert len(cmds) == 2, cmds
    assert "pytest" not in cmds[0] and "pytest" in cmds[1]


def ci_lines() -> list[str]:
    """The commands of .ci/run (comments and blank lines left out)."""
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_test_line_verbatim():
    ci = ci_lines()
    assert quick_start_commands()[1] in ci
    # and installs the CPU torch wheel explicitly before it
    assert ci.index("python -m pip install torch==2.13.0") < ci.index(quick_start_commands()[1])


def test_ci_installs_into_a_fresh_virtual_environment():
    # as a newcomer: a new venv (not the machine's site-packages, which may hold older versions that
    # hide a failure on the newest ones), activated before anything is installed or run
    ci = ci_lines()
    make = [i for i, line in enumerate(ci) if re.fullmatch(r'python3? -m venv "\$venv"', line)]
    activate = [i for i, line in enumerate(ci) if line == 'source "$venv/bin/activate"']
    assert make and activate and make[0] < activate[0], ci
    assert any(re.fullmatch(r'venv="\$\(mktemp -d\)/venv"', line) for line in ci[:make[0]]), ci
    assert not any("--system-site-packages" in line or "--user" in line for line in ci), ci
    installs = [i for i, line in enumerate(ci) if "pip install" in line or "pytest" in line]
    assert installs and min(installs) > activate[0], ci
    # no version pins beyond the README's torch: pip takes the newest versions setup.cfg admits
    for line in ci:
        if "pip install" in line:
            pins = re.findall(r"\S+==\S+", line)
            assert all(p == "torch==2.13.0" for p in pins), line
            assert "--upgrade-strategy only-if-needed" not in line and "-c " not in line, line


def test_ci_installs_the_models_extra_as_the_readme_says():
    readme = (ROOT / "README.md").read_text()
    line = "pip install torch==2.13.0 -e '.[models]'"
    assert line in readme and line in ci_lines()


def python_files(root: Path = ROOT):
    """The project's own .py files: not in hidden folders, build outputs, site-packages or a virtual
    environment (a folder holding pyvenv.cfg, e.g. the ``python -m venv venv`` a newcomer makes in
    the checkout: its third-party files need not even parse under this Python)."""
    import os

    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in {"build", "dist", "site-packages",
                                                                              "__pycache__"}
                         and not (Path(here) / d / "pyvenv.cfg").exists())
        yield from (Path(here) / f for f in sorted(files) if f.endswith(".py"))


def test_python_files_skip_a_virtual_environment_in_the_checkout(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch"
    site.mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (site / "newer.py").write_text("type Alias = int\n")  # Python 3.12 syntax
    (tmp_path / "env2" / "site-packages").mkdir(parents=True)  # a venv without its pyvenv.cfg
    (tmp_path / "env2" / "site-packages" / "x.py").write_text("type Alias = int\n")
    assert [p.relative_to(tmp_path).as_posix() for p in python_files(tmp_path)] == ["pkg/mod.py"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def test_no_jax_anywhere():
    offenders = [str(p) for p in python_files() if {"jax", "jaxlib", "flax"} & imported_modules(p)]
    assert not offenders


def test_anvil_ref_never_imports_the_fast_path():
    allowed = {"numpy", "torch", "mpmath", "scipy", "__future__", "anvil_ref"}
    stdlib = set(sys.stdlib_module_names)
    for p in (ROOT / "anvil_ref").rglob("*.py"):
        bad = imported_modules(p) - allowed - stdlib
        assert not bad, f"{p.name} imports {bad}"
        assert "torch.compile(" not in p.read_text(), p.name


def test_derive_maps_takes_no_private_name_of_the_fast_path():
    """derive_maps measures the fast path through its public names, and the rounding model reads its
    constants from anvil_ref.constants: derive_maps/robust.py imports no anvil_fast at all."""
    private = [f"{p.name}: {node.module}.{a.name}" for p in sorted((ROOT / "derive_maps").rglob("*.py"))
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("anvil_fast") for a in node.names if a.name.startswith("_")]
    assert not private
    assert "anvil_fast" not in imported_modules(ROOT / "derive_maps" / "robust.py")


def test_no_installed_package_imports_the_test_folder():
    """tests/ is not installed: a package module importing it fails (or, caught, silently degrades)
    in an installed package."""
    offenders = [str(p.relative_to(ROOT)) for pkg in ("anvil_ref", "anvil_fast", "derive_maps")
                 for p in (ROOT / pkg).rglob("*.py") if "tests" in imported_modules(p)]
    assert not offenders


def test_setup_cfg_declares_the_packages_and_extras():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    # setuptools' own reader: a multi-line value splits on lines only, so a comma list broken across
    # lines reads as one bogus package name; configparser alone would not see it
    from setuptools.config.setupcfg import read_configuration
    pkgs = set(read_configuration(ROOT / "setup.cfg")["options"]["packages"])
    assert {"anvil_ref", "anvil_fast", "derive_maps"} <= pkgs
    # every sub-package is declared too, or an installed package lacks it
    subpackages = {".".join(p.parent.relative_to(ROOT).parts) for top in ("anvil_ref", "anvil_fast", "derive_maps")
                   for p in (ROOT / top).rglob("__init__.py")}
    assert subpackages <= pkgs, subpackages - pkgs
    assert "pytest" in cfg["options.extras_require"]["test"]
    # the optional real-model tests' extra, installed by CI
    assert "transformers" in cfg["options.extras_require"]["models"]
    assert "pip install torch==2.13.0 -e '.[models]'" in (ROOT / ".ci" / "run").read_text().splitlines()
    reqs = cfg["options"]["install_requires"]
    assert "torch>=2.9" in reqs and "jax" not in reqs
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[build-system]" in pyproject and "[project]" not in pyproject


def test_main_job_runs():
    out = subprocess.run([sys.executable, "-m", "anvil_ref", "demo", "--shape", "2", "12", "8"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = out.splitlines()[2:]
    assert len(rows) == 2
    for row in rows:
        lo, hi = (float(v) for v in re.findall(r"([0-9.e+-]+)\.\.\s*([0-9.e+-]+)", row)[-1])
        assert 0.99 < lo <= hi < 1.01  # the cascade drives the spectrum to ~1


#: Whose imports are checked for cycles: the three packages, and the paper's generators (which the
#: build imports and which must not import the build back).
PACKAGES = ("anvil_ref", "anvil_fast", "derive_maps", "papers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (top level or inside a
    function: a deferred import still ties the two modules together)."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                deps |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_reports_a_cycle_by_its_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_import_graph_sees_relative_and_deferred_imports():
    graph = package_import_graph()
    assert "anvil_fast.kernels.backend" in graph["anvil_fast.kernels.gram"]  # top level, relative
    assert "anvil_fast.core.bank" in graph["anvil_fast.bench.bank"]  # inside a function, two dots up
    assert "anvil_ref.constants" in graph["anvil_fast.bench.bank"]  # absolute


def test_no_import_cycles_in_the_packages():
    cycles = import_cycles(package_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


#: Words that narrate the project's history or point outside the repository. A comment, a CLI string
#: or the paper says why something is as it is; history belongs in git, results/ folder names are data.
HISTORY_PHRASES = re.compile(r"\brun [0-9]+\b|\bissues? ?#?[0-9]+|\bthe issue's\b|\bfirst version\b|\bpreviously\b|"
                             r"\bunchanged from\b|METHOD\.md|device notes|\.\./shared/", re.IGNORECASE)


def history_sources():
    for pkg in ("anvil_ref", "anvil_fast", "derive_maps", "tools", "papers", "tests"):
        for p in sorted((ROOT / pkg).rglob("*")):
            if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts and p != Path(__file__).resolve():
                yield p
    yield ROOT / "papers" / "anvil.template.md"
    yield ROOT / "README.md"
    yield ROOT / "tests" / "README.md"


def test_the_history_grep_catches_each_phrase():
    for text in ("as in run 3", "Issue 5's measurements", "(issue 3)", "the issue's statements", "unchanged from the "
                 "first version", "previously", "METHOD.md of the device notes", "../shared/seed/x.txt"):
        assert HISTORY_PHRASES.search(text), text
    for text in ("results/anvil_fast_h200/run3/bench.log", "run the tests", "a known issue of the interpreter"):
        assert not HISTORY_PHRASES.search(text), text


def test_sources_do_not_narrate_history():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in history_sources() if p.is_file()
            for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY_PHRASES.search(line)]
    assert not hits, "\n".join(hits)
