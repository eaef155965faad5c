"""docs/framework-differences.md, written by code so it cannot drift from the code.

For each part of the model the page shows the golden's NumPy next to the PyTorch and JAX
versions, as excerpts cut out of the real source files (by function or class name, with the
ast module), what the ONNX export makes of it (counted in the exported graphs), and every
difference that matters with the number measured by `rosetta probe` or computed here, and the
command that reproduces it. ``rosetta differences --markdown docs/framework-differences.md``
writes it; a test regenerates the page and compares.
"""

from __future__ import annotations

import ast
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance.probe import observation

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = {"NumPy (golden)": "impl_numpy/model.py", "PyTorch": "impl_torch/model.py", "JAX / Flax": "impl_jax/model.py"}


def excerpt(path: str, name: str) -> str:
    """The source of a top-level function or class, or Class.method, in a file of this repository."""
    tree = ast.parse((ROOT / path).read_text())
    lines = (ROOT / path).read_text().splitlines()
    scope: list[ast.stmt] = tree.body
    node = None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise KeyError(f"{path} has no {name}")
        scope = node.body
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    return textwrap.dedent("\n".join(lines[start:node.end_lineno]))


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    names: dict[str, str | tuple[str, ...]]  # implementation label -> function/class name(s) in its file


SECTIONS = [
    Section("Weight layouts and transposes",
            "The spec stores a linear map as `[in, out]` and computes `x @ W + b`, as the paper writes it.",
            {"NumPy (golden)": "linear", "PyTorch": "Transformer.from_params", "JAX / Flax": "_variable"}),
    Section("Positional encoding layouts",
            "PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...): interleaved in the paper, "
            "`sinusoidal-concat` puts all sines first (tensor2tensor's layout).",
            {name: "sinusoidal_table" for name in IMPLEMENTATIONS}),
    Section("Where 1/√d_k is applied, mask polarity and rows with no key",
            "softmax(QKᵀ/√d_k)V with a boolean keep-mask (True = may attend); a query row with no key "
            "outputs zeros (SPEC.md §6).",
            {"NumPy (golden)": "scaled_dot_product_attention", "PyTorch": "scaled_dot_product_attention",
             "JAX / Flax": ("scaled_dot_product_attention", "_attention")}),
    Section("Splitting heads",
            "Heads are contiguous blocks of d_k columns: [B, T, d] → [B, H, T, d_k].",
            {name: "split_heads" for name in IMPLEMENTATIONS}),
    Section("LayerNorm: variance and eps",
            "γ (x − μ) / √(σ² + ε) + β with the biased variance and the config's ε.",
            {"NumPy (golden)": "layer_norm", "PyTorch": "Norm", "JAX / Flax": "Norm"}),
    Section("GELU",
            "`gelu` is the exact erf form; `gelu-tanh` the tanh approximation. The config chooses.",
            {"NumPy (golden)": "gelu", "PyTorch": "ACTIVATIONS", "JAX / Flax": "gelu"}),
    Section("Matmul precision (TF32)",
            "Conformance states the float32 matmul precision on every run ('highest'); the `tf32` column "
            "of the matrix is the same float32 model with TF32 matmuls, on CUDA only.",
            {"PyTorch": "conformance/backends/torch_backend.py::matmul_precision",
             "JAX / Flax": "conformance/backends/jax_backend.py::JaxRunner._scope"}),
    Section("KV-cache shapes",
            "The golden: L decoder layers × (keys, values) of [B, H, P, d_k] for the P positions decoded, "
            "plus their keep-vector. The frameworks: keys and values of [L, B, H, C, d_k] for a capacity C, "
            "the keep-vector [B, C] and the length P.",
            {name: "KVCache" for name in IMPLEMENTATIONS}),
]


def _assignment(path: str, name: str) -> str:
    """The source of a top-level assignment (e.g. a dict of activations)."""
    tree = ast.parse((ROOT / path).read_text())
    lines = (ROOT / path).read_text().splitlines()
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return "\n".join(lines[node.lineno - 1:node.end_lineno])
    raise KeyError(f"{path} has no {name}")


def source_of(path: str, name: str) -> str:
    return _assignment(path, name) if name.isupper() else excerpt(path, name)


# ---- numbers computed here ---------------------------------------------------------------------

def _positional_errors() -> dict[str, float]:
    """Max |PE - golden| over positions 0..4095, d 512: float64 angles rounded to float32 at the
    end (what impl_torch/impl_jax do) against float32 angles (what a float32 arange would give)."""
    import impl_numpy as golden

    positions = np.arange(4096)
    exact = golden.sinusoidal_table(positions, 512, "sinusoidal")
    rounded_at_end = exact.astype(np.float32)
    inverse = (10000.0 ** (-np.arange(0, 512, 2, dtype=np.float32) / np.float32(512))).astype(np.float32)
    angles = positions.astype(np.float32)[:, None] * inverse[None, :]
    in_float32 = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(4096, 512)
    return {"float64 angles": float(np.abs(rounded_at_end - exact).max()),
            "float32 angles": float(np.abs(in_float32 - exact).max())}


def _onnx_ops() -> dict[str, Counter]:
    """Operator counts in the tiny preset's exported forward graph at opsets 23 and 20."""
    import onnx

    from export.cache import exported
    from spec import get_preset, init_params

    cfg = get_preset("tiny")
    params = init_params(cfg, seed=0)
    counts = {}
    for opset in (23, 20):
        graph = onnx.load(str(exported(cfg, params, opset=opset) / "forward.onnx")).graph
        counts[str(opset)] = Counter(node.op_type for node in graph.node)
    return counts


def _kv_names() -> tuple[list[str], list[str]]:
    from export.graphs import DECODER_STEP, signature
    from spec import get_preset

    sig = signature(get_preset("tiny"), DECODER_STEP)
    return ([f"`{t.name}` {list(t.dims)}" for t in sig.inputs if t.name.startswith("past")][:2],
            [f"`{t.name}` {list(t.dims)}" for t in sig.outputs if t.name.startswith("present")][:2])


# ---- the page ----------------------------------------------------------------------------------

MEASURED, EXPLAINED = "measured", "explained"  # a number this run saw, or a reading of the code


def _differences(observed, positional: dict[str, float], ops: dict[str, Counter]) -> dict[str, list[tuple[str, str]]]:
    """Each section's items, as (MEASURED, text) when the text quotes what this run measured or
    computed, (EXPLAINED, text) when it reads the code above or the frameworks' documentation."""
    p = lambda topic, primitive: observation(observed, topic, primitive)  # noqa: E731
    past, present = _kv_names()
    linear_ops = {k: ops[k]["MatMul"] + ops[k]["Gemm"] for k in ops}
    return {
        "Weight layouts and transposes": [
            (MEASURED, f"ONNX (torch export): the tiny forward graph holds {linear_ops['23']} MatMul/Gemm nodes whose "
                       "weights are initializers in the exporter's own layout."),
            (EXPLAINED, "PyTorch's `nn.Linear` stores `[out, in]` and computes `x @ Wᵀ`: every Linear weight is "
                        "transposed on the way in and out, nothing else changes (`tests/test_torch.py`)."),
            (EXPLAINED, "Flax's `nnx.Linear` kernel is `[in, out]` like the spec: no transpose, only the leaf name "
                        "(`kernel` for `weight`, `embedding` for an embedding's `weight`)."),
            (EXPLAINED, "An exported graph's metadata carries the weights' SHA-256, so a graph is tied to the file it "
                        "came from (`rosetta export`)."),
        ],
        "Positional encoding layouts": [
            (MEASURED, f"Angles in float64, rounded to float32 at the end (impl_torch, impl_jax, the golden at "
                       f"float32): max error {positional['float64 angles']:.1e} over positions 0–4095 at d=512; the "
                       f"same table from float32 angles: {positional['float32 angles']:.1e}."),
            (EXPLAINED, "impl_jax makes the table on the host in NumPy (JAX has float64 only in x64 mode); so its ONNX "
                        "export holds a table of max_len positions, while the torch export computes the sinusoids in "
                        "the graph (docs/onnx.md)."),
        ],
        "Where 1/√d_k is applied, mask polarity and rows with no key": [
            (MEASURED, f"Fully masked row, torch SDPA (CPU): {p('fully masked row', 'torch F.scaled_dot_product_attention')}; "
                       f"`nn.MultiheadAttention`: {p('fully masked row', 'torch nn.MultiheadAttention')}; "
                       f"`jax.nn.dot_product_attention`: {p('fully masked row', 'jax.nn.dot_product_attention')}; "
                       f"onnxruntime `Attention`: {p('fully masked row', 'onnxruntime Attention')}."),
            (MEASURED, f"SDPA's boolean mask: {p('mask forms', 'torch F.scaled_dot_product_attention')}."),
            (MEASURED, f"Fill values before a softmax, for an all-masked row: "
                       f"{p('fill values, all-masked row', 'torch.softmax after a fill')}."),
            (MEASURED, f"`jax.nn.dot_product_attention` at float64: "
                       f"{p('float64 attention', 'jax.nn.dot_product_attention')}."),
            (MEASURED, f"ONNX: at opset 23 the tiny forward graph has {ops['23']['Attention']} `Attention` nodes and "
                       f"{ops['23']['Softmax']} `Softmax`; at opset 20 it has {ops['20']['Attention']} and "
                       f"{ops['20']['Softmax']}. onnxruntime's Attention and a `[B,1,1,K]` mask: "
                       f"{p('mask broadcasting', 'onnxruntime Attention')}."),
            (EXPLAINED, "No fill value gives the spec's zeros, so every implementation enforces the row rule itself "
                        "(the `all_pad` cells check it)."),
            (EXPLAINED, "`nn.MultiheadAttention`'s `key_padding_mask` has the opposite polarity (True = ignore)."),
            (EXPLAINED, "`jax.nn.dot_product_attention` takes its softmax in float32 whatever the input, so impl_jax "
                        "sends float64 through its explicit path; the report names the path each cell took."),
        ],
        "Splitting heads": [
            (EXPLAINED, "The same reshape-then-transpose in all three; reshaping `[B, T, d]` straight to "
                        "`[B, H, T, d_k]` without the transpose is mutation `heads_reshape` "
                        "(docs/mutation-gallery.md)."),
            (EXPLAINED, "`jax.nn.dot_product_attention` wants `[B, T, H, d_k]` (heads after the sequence axis): "
                        "impl_jax swaps axes around the call."),
        ],
        "LayerNorm: variance and eps": [
            (MEASURED, f"`torch.nn.LayerNorm` default: {p('LayerNorm defaults', 'torch.nn.LayerNorm')}; "
                       f"`flax.nnx.LayerNorm` default: {p('LayerNorm defaults', 'flax.nnx.LayerNorm')}."),
            (EXPLAINED, "Flax's `use_fast_variance` takes E[x²] − E[x]² in one pass, which cancels on values far "
                        "from 0; our norms pass the config's eps and take two passes."),
            (EXPLAINED, "Half-precision activations: both implementations take the statistics in float32 and cast "
                        "back."),
        ],
        "GELU": [
            (MEASURED, f"`torch.nn.functional.gelu` default: {p('GELU default', 'torch.nn.functional.gelu')}; "
                       f"`jax.nn.gelu` default: {p('GELU default', 'jax.nn.gelu')}."),
            (EXPLAINED, "Both implementations choose the form from the config, never the default."),
        ],
        "Matmul precision (TF32)": [
            (MEASURED, f"torch's default here: {p('matmul precision', 'torch')}; jax's: {p('matmul precision', 'jax')}."),
            (EXPLAINED, "On NVIDIA GPUs JAX's default float32 matmul rounds its inputs to TF32 and PyTorch's does "
                        "not (their documentation), so both backends state the precision on every run."),
            (EXPLAINED, "ONNX graphs carry no precision setting: on CUDA, onnxruntime's provider options decide "
                        "(`rosetta check --devices cuda` measures the result)."),
        ],
        "KV-cache shapes": [
            (MEASURED, f"The ONNX decoder_step graph takes {', '.join(past)}, … and returns {', '.join(present)}, … "
                       "at the same capacity."),
            (EXPLAINED, "Both preallocate `capacity` positions and attend over all of them under a mask, for "
                        "different reasons: impl_jax because XLA compiles once per shape, so it writes with "
                        "`dynamic_update_slice` and returns a new cache; impl_torch because a growing cache "
                        "allocates every step and, on a GPU, plans a new attention kernel for every key length, so "
                        "it writes into its buffers in place (a cache is continued one way; `copy()` one to branch, "
                        "and a stale branch is refused)."),
            (EXPLAINED, "The decoder_step graph is impl_torch's step: the new positions are written into copies (a "
                        "graph never writes its inputs); the runner keeps two sets of buffers on the device and "
                        "swaps them each step, so every step binds the same buffers."),
        ],
    }


def differences_page() -> str:
    from conformance.probe import framework_versions, run_probes

    observed = run_probes(["cpu"])  # the page quotes the CPU's behaviour
    found = _differences(observed, _positional_errors(), _onnx_ops())
    versions = framework_versions()
    lines = ["# Where the frameworks differ, side by side", "",
             "Generated by `rosetta differences --markdown docs/framework-differences.md` from the source files "
             "and from measurements made by the same run (`rosetta probe` for the frameworks' own primitives); "
             "a test regenerates it. The three implementations are parallel texts: same names, same order.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), ""]
    for section in SECTIONS:
        lines += [f"## {section.title}", "", section.intro, ""]
        for label, names in section.names.items():
            for name in (names,) if isinstance(names, str) else names:
                path, name = name.split("::") if "::" in name else (IMPLEMENTATIONS[label], name)
                lines += [f"**{label}** — `{path}` · `{name}`", "", "```python", source_of(path, name), "```", ""]
        for kind, heading in ((MEASURED, "What differs, measured by this run (`rosetta probe`, the exported graphs):"),
                              (EXPLAINED, "Why, from the code above and the frameworks' documentation (not measured):")):
            items = [text for item_kind, text in found[section.title] if item_kind == kind]
            if items:
                lines += [heading, ""] + [f"- {text}" for text in items] + [""]
    return "\n".join(lines)
