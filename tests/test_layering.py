"""Architecture rules: layers import only downward, and only ``certvllm.vllm_plugin`` imports vLLM."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import certvllm

ROOT = Path(certvllm.__file__).parent
# lowest first; a module may import its own layer or any layer listed before it
LAYERS = [
    ("config", "formats", "bounds", "models"),
    ("kernels",),
    ("kv",),
    ("attention", "testing"),
    ("metrics",),
    ("vllm_plugin",),
    ("cli", "eval", "server"),
]


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "certvllm" or len(parts) < 2:
        return None
    name = parts[1]
    if name in ("configs", "csrc"):
        return 0
    if name == "triton_kernels":
        name = "kernels"
    for i, names in enumerate(LAYERS):
        if name in names:
            return i
    raise AssertionError(f"{module} is not assigned to a layer in tests/test_layering.py")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_only_the_plugin_package_imports_vllm_and_layers_point_down():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        own = _layer_of(module) if module != "certvllm" else None
        for imported in _imports(path):
            if imported.split(".")[0] == "vllm":
                assert module.startswith("certvllm.vllm_plugin"), f"{module} imports vllm"
            target = _layer_of(imported)
            if own is not None and target is not None:
                assert target <= own, f"{module} (layer {own}) imports upward: {imported} (layer {target})"


def test_triton_kernels_ship_inside_our_namespace():
    assert importlib.util.find_spec("certvllm.triton_kernels") is not None
    spec = importlib.util.find_spec("triton_kernels")
    # vLLM would import a top-level triton_kernels in place of its own: we must never provide one
    assert spec is None or "certvllm" not in str(spec.origin or "")
