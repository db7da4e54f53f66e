"""Architecture rules over the whole shipped tree (``certvllm/`` and ``triton_kernels/``, which ships as
``certvllm.triton_kernels``): layers import only downward, the kernel layer knows nothing above the
formats and the bounds, only ``certvllm.vllm_plugin`` imports vLLM, and only ``certvllm.env`` reads the
environment."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import certvllm

REPO = Path(__file__).resolve().parents[1]
# the shipped source folders and the package each ships as (pyproject.toml's package-dir)
SHIPPED = {"certvllm": "certvllm", "triton_kernels": "certvllm.triton_kernels", "configs": "certvllm.configs"}
# lowest first; a module may import its own layer or any layer listed before it
LAYERS = [
    ("env", "formats"),
    ("bounds",),
    ("kernels", "triton_kernels", "csrc", "configs"),
    ("config", "models"),
    ("kv",),
    ("attention", "testing"),
    ("metrics",),
    ("vllm_plugin",),
    ("cli", "eval", "server"),
]
# the kernel layer takes typed parameters and returns tensors: it may import only these from certvllm (and the
# build-once loader of its compiled extensions, in the same layer)
KERNEL_IMPORTS = ("certvllm.formats", "certvllm.bounds", "certvllm.triton_kernels", "certvllm.kernels.jit")


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "certvllm" or len(parts) < 2:
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is not assigned to a layer in tests/test_layering.py")


def _modules() -> Iterator[tuple[str, Path]]:
    for folder, package in SHIPPED.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            yield ".".join((package, *rel.parts)).removesuffix(".__init__"), path


def _imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module:
                found.append(node.module)
    return found


def test_the_walk_covers_every_shipped_python_file():
    modules = dict(_modules())
    assert "certvllm.triton_kernels.finalize" in modules and "certvllm.attention.op" in modules
    assert len(modules) == sum(1 for f in SHIPPED for _ in (REPO / f).rglob("*.py"))
    assert Path(certvllm.__file__).parent == REPO / "certvllm"


def test_layers_point_down_and_only_the_plugin_imports_vllm():
    for module, path in _modules():
        own = _layer_of(module)
        for imported in _imports(module, path):
            if imported.split(".")[0] == "vllm":
                assert module.startswith("certvllm.vllm_plugin"), f"{module} imports vllm"
            target = _layer_of(imported)
            if own is not None and target is not None:
                assert target <= own, f"{module} (layer {own}) imports upward: {imported} (layer {target})"


def test_the_kernel_layer_imports_only_formats_and_bounds():
    for module, path in _modules():
        if not module.startswith("certvllm.triton_kernels"):
            continue
        for imported in _imports(module, path):
            if imported.startswith("certvllm"):
                assert imported.startswith(KERNEL_IMPORTS), f"{module} imports {imported}"


def test_only_the_env_module_reads_the_environment():
    for module, path in _modules():
        if module == "certvllm.env":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                line = path.read_text().splitlines()[node.lineno - 1]
                allowed = module == "certvllm.triton_kernels" and "setdefault" in line  # interpreter switch, a write
                assert allowed, f"{module}:{node.lineno} reads the environment: {line.strip()}"


def test_triton_kernels_ship_inside_our_namespace():
    assert importlib.util.find_spec("certvllm.triton_kernels") is not None
    spec = importlib.util.find_spec("triton_kernels")
    # vLLM would import a top-level triton_kernels in place of its own: we must never provide one
    assert spec is None or "certvllm" not in str(spec.origin or "")
