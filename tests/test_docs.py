"""The docs run and stay complete: every ```python block executes, every option and public name
is documented."""

import ast
import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import lwjax
from lwjax import logical as logical_lib
from lwjax import muon as muon_lib
from lwjax import newton_schulz as newton_schulz_lib
from lwjax import optimizer as optimizer_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = (
    "index",
    "architecture",
    "concepts",
    "quickstart",
    "routing",
    "configuration",
    "migration",
    "troubleshooting",
    "api",
    "benchmarks",
    "multihost",
    "optax",
    "own-step",
    "megatron",
    "scaling",
)
PAGES_WITHOUT_PYTHON = ("index", "architecture", "benchmarks")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SIGNATURE_BLOCK = re.compile(r"^### `([\w.]+)`\n+```text\n(.*?)^```", re.S | re.M)


CLI_SPAN = re.compile(r"`(lwjax (?:layout|routes|plan)\s[^`]+)`")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.S | re.M)
CLI_LINE = re.compile(r"^(?:\S*/)?lwjax (?:layout|routes|plan)\s")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|\.\.\.|[\[|{]")  # NAME, FILE.json, [--x]


def documented_cli_commands() -> list[tuple[str, list[str]]]:
    """``(page, argv)`` of every ``lwjax layout``/``lwjax routes`` command line in README.md and
    docs/, in code spans and shell blocks; templates (``--preset NAME``, ``[--json]``) left out."""
    commands = []
    for path in (ROOT / "README.md", *sorted(DOCS.glob("*.md"))):
        text = path.read_text()
        lines = CLI_SPAN.findall(text) + [
            line
            for block in SHELL_BLOCK.findall(text)
            for line in block.splitlines()
            if CLI_LINE.match(line)
        ]
        for line in lines:
            argv = line.split("#")[0].split()[1:]
            if not any(PLACEHOLDER.search(arg) for arg in argv):
                commands.append((path.name, argv))
    return commands


def python_blocks(path: pathlib.Path) -> list[str]:
    return PYTHON_BLOCK.findall(path.read_text())


def run_blocks(path: pathlib.Path, namespace: dict) -> int:
    """Execute a page's python blocks in order, in one namespace, as a reader pasting them would."""
    blocks = python_blocks(path)
    for i, block in enumerate(blocks):
        exec(compile(block, f"{path.name}, python block {i + 1}", "exec"), namespace)  # noqa: S102
    return len(blocks)


def test_docs_pages_exist():
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(PAGES)


@pytest.mark.parametrize("page", [p for p in PAGES if p != "api"] + ["api"])
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page}"}
    if page == "megatron":  # the page's examples read real megatron-core checkpoints
        fixtures = ROOT / "tests" / "fixtures" / "megatron"
        namespace.update(
            CKPT=str(fixtures / "resume_muon"),
            ADAM_CKPT=str(fixtures / "resume_adam"),
            DATA=str(fixtures / "gpt_data" / "docs"),
        )
    count = run_blocks(DOCS / f"{page}.md", namespace)
    assert count >= (0 if page in PAGES_WITHOUT_PYTHON else 1)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    """README's snippets run as pasted, in order, with nothing defined beforehand."""
    monkeypatch.chdir(tmp_path)
    assert run_blocks(ROOT / "README.md", {"__name__": "readme"}) >= 2


def test_multihost_script_as_one_process_sees_the_8_device_mesh_the_two_processes_see(tmp_path):
    """docs/multihost.md's one-process command line builds the mesh of its
    ``lwjax launch --nproc 2 --devices-per-proc 4`` line."""
    text = (DOCS / "multihost.md").read_text()
    (tmp_path / "train.py").write_text(python_blocks(DOCS / "multihost.md")[0])
    assert "lwjax launch --nproc 2 --devices-per-proc 4 -- python train.py" in text
    command = re.search(r"`((?:\w+=\S+ )*)python train\.py`", text).group(1)
    env = dict(pair.split("=") for pair in command.split())
    script = "import runpy; print('mesh size', runpy.run_path('train.py')['mesh'].size)"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "step 2" in result.stdout and "mesh size 8" in result.stdout, result.stdout


def test_documented_cli_commands_run(capsys):
    """Each ``lwjax layout``/``routes``/``plan`` command the docs show exits 0 as written."""
    from lwjax.tools.cli import main

    commands = documented_cli_commands()
    assert len(commands) >= 4, commands
    for page, argv in commands:
        code = main(argv)
        assert code == 0, f"{page}: lwjax {' '.join(argv)} exited {code}: {capsys.readouterr().err}"


def _option_names() -> dict[str, list[str]]:
    """Every user-facing option: constructor arguments and config fields."""
    skip = {"params", "mesh", "routing", "loss_fn", "optimizer"}
    return {
        "layerwise_muon": [
            n for n in inspect.signature(lwjax.layerwise_muon).parameters if n not in skip
        ],
        "make_train_step": [
            n for n in inspect.signature(lwjax.make_train_step).parameters if n not in skip
        ],
        "route_leaves": [
            n
            for n in inspect.signature(lwjax.route_leaves).parameters
            if n not in ("leaves", "rules")
        ],
        "OptimizerConfig": [f.name for f in dataclasses.fields(lwjax.OptimizerConfig)],
        "MuonConfig": [f.name for f in dataclasses.fields(lwjax.MuonConfig)],
        "LayoutConfig": [f.name for f in dataclasses.fields(lwjax.LayoutConfig)],
        "RoutingRules": [f.name for f in dataclasses.fields(lwjax.RoutingRules)],
    }


@pytest.mark.parametrize("owner", list(_option_names()))
def test_configuration_reference_lists_every_option_with_its_default(owner):
    text = (DOCS / "configuration.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    missing = [n for n in _option_names()[owner] if n not in rows]
    assert not missing, f"docs/configuration.md lacks rows for {owner} options {missing}"
    if owner in ("OptimizerConfig", "MuonConfig", "LayoutConfig"):
        for field in dataclasses.fields(getattr(lwjax, owner)):
            shown = {f"`{field.default!r}`", f'`"{field.default}"`'}
            assert any(s in rows[field.name] for s in shown), (owner, field.name, field.default)


def test_configuration_reference_names_the_megatron_flags():
    text = (DOCS / "configuration.md").read_text()
    flags = [
        "--optimizer muon --use-distributed-optimizer",
        "--muon-momentum",
        "--muon-use-nesterov",
        "--muon-scale-mode",
        "--muon-extra-scale-factor",
        "--muon-num-ns-steps",
        "--muon-coefficient-type",
        "--muon-fp32-matmul-prec",
        "--muon-no-split-qkv",
        "--clip-grad",
        "--weight-decay",
        "--ddp-bucket-size",
        "--accumulate-allreduce-grads-in-fp32",
        "--ddp-pad-buckets-for-high-nccl-busbw",
        "--adam-beta1",
        "--adam-beta2",
        "--adam-eps",
        "--lr",
    ]
    assert [f for f in flags if f"`{f}" not in text] == []


def _public_api() -> dict[str, object]:
    """``lwjax.__all__``, ``lwjax.megatron.__all__``, the public names of the Muon math modules,
    and named extras."""
    from lwjax.tools.demo import data, devices, model, run

    names = {
        f"lwjax.{name}": getattr(lwjax, name) for name in lwjax.__all__ if name != "__version__"
    }
    for module in (muon_lib, newton_schulz_lib):
        for name, obj in vars(module).items():
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
                names[f"{module.__name__}.{name}"] = obj
    extras = {
        logical_lib: ("LogicalState",),
        optimizer_lib: ("state_shardings",),
        run: ("run_demo", "DemoConfig"),
        model: ("GPT", "GPTConfig", "lwjax_routing", "make_loss_fn", "stack_blocks"),
        data: ("load_stdlib_corpus",),
        devices: ("local_mesh",),
    }
    for module, members in extras.items():
        for name in members:
            names[f"{module.__name__}.{name}"] = getattr(module, name)
    import lwjax.megatron as megatron_lib

    names.update({f"lwjax.megatron.{n}": getattr(megatron_lib, n) for n in megatron_lib.__all__})
    return names


def _parameter_names(signature: str) -> list[str]:
    """Parameter names of a documented ``name(params...)`` signature, defaults and all."""
    source = "def f" + signature[signature.index("(") :].strip() + ": pass"
    args = ast.parse(source).body[0].args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    return names + ([args.kwarg.arg] if args.kwarg else [])


def test_api_reference_covers_the_public_api_with_current_signatures():
    text = (DOCS / "api.md").read_text()
    documented = dict(SIGNATURE_BLOCK.findall(text))
    missing = [name for name in _public_api() if name not in documented]
    assert not missing, f"docs/api.md has no entry for {missing}"
    for name, obj in _public_api().items():
        if not callable(obj) or isinstance(obj, type) and issubclass(obj, tuple):
            continue
        target = (
            obj.__init__ if isinstance(obj, type) else obj
        )  # nnx modules hide the signature of __init__
        wanted = [n for n in inspect.signature(target).parameters if n != "self"]
        shown = _parameter_names(documented[name])
        assert shown == wanted, f"docs/api.md: {name} documents {shown}, code has {wanted}"


def test_lazy_exports_are_the_type_checking_imports():
    """``lwjax``'s lazily loaded names are exactly those its ``TYPE_CHECKING`` block imports."""
    tree = ast.parse(pathlib.Path(lwjax.__file__).read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    imported = {a.asname: node.module for node in block.body for a in node.names}
    assert imported == lwjax._LAZY
    assert all(getattr(lwjax, name) is not None for name in lwjax.__all__)


def test_architecture_module_map_names_every_module():
    """docs/architecture.md's module map lists every module of the package (tools by folder)."""
    text = (DOCS / "architecture.md").read_text()
    package = ROOT / "lwjax"
    modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
    modules += [p for p in (package / "tools").glob("*.py") if p.name != "__init__.py"]
    missing = [p.name for p in modules if p.name not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
    assert "lwjax/megatron/" in text and "demo/" in text


@pytest.mark.parametrize("module", ["optimizer", "parallel.mesh", "train", "routing", "policies"])
def test_core_docstring_examples_run(module):
    """The Examples blocks of the entry points run as written."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"lwjax.{module}"))
    assert result.failed == 0 and result.attempted > 0
