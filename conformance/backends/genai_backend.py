"""The ``onnxruntime-genai`` column: an ONNX implementation of an imported checkpoint that nobody
traced from our code.

onnxruntime-genai's model builder reads the Hugging Face directory and writes its ONNX graph by
hand (GroupQueryAttention with the rotation inside it, SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization), and genai's generator runs it with its own KV cache and its
own greedy search. The column builds that model at float32 for the CPU and checks, against the
golden, the whole-model cases genai's API can express:
- forward: the prompt's logits at every position (the generator's first run, ``get_output``);
- decode: a row at a time (genai appends tokens to a batch only once), the prefix in one call,
  then one token per call through genai's cache, each step's logits;
- generate: genai's greedy search on the batch, with the case's eos_id.

What genai computes differently is reported, not hidden: the rows (and decode steps) it cannot
compute the spec's way are left out of the comparison with their cause (measured in
tests/test_genai.py), and every other row is compared at every position (adapter.Partial):
- its attention reads the attention mask as each row's length (GroupQueryAttention's seqlens_k):
  a row with n real tokens is computed as if its first n slots were real, pads among them (a
  left-padded row's logits, where genai's length says real, equal the golden's with that keep);
- its generator takes every appended token as real: a pad fed as a decode step attends and is
  attended (the real steps of such a row agree; the pad steps do not);
- a row with no real token is a length of 0, which its GroupQueryAttention refuses;
- with a sliding window (Gemma 2), its windowed cache refuses a batch row shorter than the
  prompt: right-padded rows are left out of the forward (RAGGED_WINDOW), and every search is
  given a length of at least the window, which its cache must hold.

The builder writes a CPU model only with a head size that its CPU GroupQueryAttention accepts (a
multiple of 16) and a multiple of 8 rotated pairs; other heads are refused by name, and so is a
sliding window (Mistral, Phi-3), which the builder drops (measured); Gemma 2's windows, which its
config.json places by layer_types, run, and so do its softcaps, four norms and query scalar, while
its embedding scale is the builder's √d rounded to two decimals (a Gemma with d = 72 fails every
logits cell by that, measured). Gemma 3 fails to build (GEMMA3_ROPE), and so does SmolLM3
(SMOLLM3_NOPE). Phi-3's longrope runs; the builder takes its attention factor from
max_position_embeddings / original_max_position_embeddings and ignores an explicit `factor` (Phi-3's
own files have none), so a file with a `factor` apart from that ratio fails the column (measured
in tests/test_genai.py). The build runs once per
process, in a temporary folder that is removed at exit.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from conformance.adapter import NotSupported, Partial
from conformance.backends.genai_builder import run_builder
from conformance.backends.staging import model_type, staged_directory
from spec import ModelConfig
from spec.config import not_computed_by

MODEL_CASES = ("forward", "decode", "generate")
# the builder's and the spec's
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "smollm3")
WINDOWED_FAMILIES = ("gemma2", "gemma3_text")  # whose config.json writes layer_types, which the builder reads
# onnxruntime's CPU GroupQueryAttention with the rotation inside it, as the builder writes it:
# "head_size shall be a multiple of 16" (without the rotation, export/in_place_step.py: of 8)
HEAD_SIZE_MULTIPLE = 16
ROTARY_PAIRS_MULTIPLE = 8  # its cos_cache "dimension 1 must be <= head_size / 2 and a multiple of 8"
LEFT_PADDING = ("onnxruntime-genai reads the attention mask as each row's length (GroupQueryAttention's "
                "seqlens_k): a row with n real tokens is computed as if its first n slots were real, so a pad "
                "before a real token is attended and a real token after it is not; the spec masks each pad "
                "where it stands (SPEC §5.2)")
PAD_STEP = ("onnxruntime-genai's generator takes every appended token as real (its attention mask grows by "
            "ones), so a pad fed as a decode step attends and is attended; the spec masks it (SPEC §5.2)")
UNPADDED_ONLY = ("a right-padded prompt is a shorter prompt to onnxruntime-genai's search, which appends after its "
                 "last real token; the spec generates after the pads (SPEC §7): the column gives the search unpadded "
                 "prompts only")
ALL_PAD = ("a row with no real token is a length of 0 to onnxruntime-genai: its GroupQueryAttention "
           "refuses it (seqlens_k = -1 is out of range); the spec defines that row's numbers (SPEC §5.2)")
RAGGED_WINDOW = ("with a sliding window, onnxruntime-genai keeps a windowed KV cache, and its GroupQueryAttention "
                 "refuses a batch whose row has fewer real tokens than the prompt's length (\"seqlens_k[r] is too "
                 "small for sequence_length\"); the spec computes a right-padded row (SPEC §5.2)")


def inexpressible(keep: np.ndarray, first_step: int | None = None) -> str | None:
    """Why genai cannot run rows whose real tokens are ``keep`` [B, L] (decode: steps from
    ``first_step`` on), or None where it can: its masks are lengths, and its steps are real."""
    keep = np.asarray(keep, dtype=bool)
    real_after = np.flip(np.logical_or.accumulate(np.flip(keep, axis=1), axis=1), axis=1)  # a real token here or later
    if not keep.any(axis=1).all():
        return ALL_PAD
    if np.any(~keep & real_after):
        return LEFT_PADDING
    if first_step is not None and not keep[:, first_step:].all():
        return PAD_STEP
    return None


def build_model(directory: Path, cfg: ModelConfig, into: Path, precision: str = "fp32") -> Path:
    """Run onnxruntime-genai's model builder (fp32, or int4 for the quantized column, CPU) on the
    directory; the output folder."""
    staged, output, log = staged_directory(directory, cfg, into), into / "model", into / "builder.log"
    arguments = ["-i", str(staged), "-o", str(output), "-p", precision, "-e", "cpu", "-c", str(into / "cache")]
    status = run_builder(arguments, log)  # as `python -m onnxruntime_genai.models.builder` runs
    if status != 0 or not (output / "genai_config.json").exists():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-6:])
        raise RuntimeError(f"onnxruntime-genai's model builder failed (exit {status}) on {directory}:\n{tail}")
    return output


class GenaiRunner:
    def __init__(self, model_directory: Path, cfg: ModelConfig):
        import onnxruntime_genai

        self.og, self.directory, self.cfg = onnxruntime_genai, model_directory, cfg
        self._models: dict[int | None, Any] = {}

    def _model(self, eos_id: int | None = None):
        """genai's model with the spec's pad token and the case's eos_id. The forward and decode
        cases only feed tokens, so their eos is the pad token, which they never feed as a step: the
        builder's own ids may lie outside the vocabulary (a model without a pad token gets
        pad = eos = vocab size), and genai refuses those."""
        if eos_id not in self._models:
            config = self.og.Config(str(self.directory))
            end = self.cfg.pad_id if eos_id is None else int(eos_id)
            config.overlay(json.dumps({"model": {"pad_token_id": self.cfg.pad_id, "eos_token_id": end}}))
            self._models[eos_id] = self.og.Model(config)
        return self._models[eos_id]

    def _generator(self, batch: int, max_length: int, eos_id: int | None = None):
        model = self._model(eos_id)
        params = self.og.GeneratorParams(model)
        # a windowed model's cache holds max_length positions and must hold the window ("KV cache capacity
        # (1) must be at least local_window_size (5)"): the search's length bounds nothing the cases read
        max_length = max(max_length, self.cfg.sliding_window or 0)
        params.set_search_options(max_length=max_length, do_sample=False, batch_size=batch)
        return self.og.Generator(model, params)

    def _left_out(self, ids: np.ndarray) -> dict[int, str]:
        """The rows genai cannot run, each with why (inexpressible, row by row)."""
        keep = np.asarray(ids) != self.cfg.pad_id
        return {row: why for row in range(len(keep)) if (why := inexpressible(keep[row:row + 1])) is not None}

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        if sublayer not in MODEL_CASES:
            raise NotSupported(f"onnxruntime-genai runs whole decoders ({', '.join(MODEL_CASES)}), not {sublayer}")
        return getattr(self, sublayer)(inputs)

    # ---- the whole-model cases: what genai cannot express is left out, the rest run as genai runs it ----
    def forward(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        ids = np.asarray(inputs["tgt_ids"])
        left_out = self._left_out(ids)
        if self.cfg.sliding_window is not None:  # a right-padded row beside longer ones: refused by the windowed cache
            left_out |= {row: RAGGED_WINDOW for row in range(len(ids))
                         if row not in left_out and (ids[row] == self.cfg.pad_id).any()}
        rows = np.array([row not in left_out for row in range(len(ids))])
        logits = np.full((*ids.shape, self.cfg.tgt_vocab_size), np.nan)
        if rows.any():
            logits[rows] = self.logits(ids[rows])
        return Partial(logits, rows, left_out) if left_out else logits

    def decode(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        """Each row's steps until the first it cannot run: a row genai cannot express is left out,
        and so is every step from the first pad fed as a step on."""
        ids, prefix = np.asarray(inputs["tgt_ids"]), inputs["prefix"]
        left_out = self._left_out(ids)
        steps = np.zeros((len(ids), ids.shape[1] - prefix), dtype=bool)
        for row in range(len(ids)):
            if row not in left_out:
                pads = np.flatnonzero(ids[row, prefix:] == self.cfg.pad_id)
                steps[row, :pads[0] if pads.size else steps.shape[1]] = True
                if pads.size:
                    left_out[row] = PAD_STEP
        logits = np.full((*steps.shape, self.cfg.tgt_vocab_size), np.nan)
        for row in np.flatnonzero(steps.any(axis=1)):
            logits[row, :steps[row].sum()] = self.step_logits(ids[row:row + 1, :prefix + steps[row].sum()], prefix)[0]
        return Partial(logits, steps, left_out) if left_out else logits

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """The generator's first run on a batch of prompts [B, L]: logits [B, L, V]."""
        generator = self._generator(ids.shape[0], ids.shape[1])
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        return np.asarray(generator.get_output("logits"), dtype=np.float64)

    def step_logits(self, ids: np.ndarray, prefix: int) -> np.ndarray:
        """Each row through its own generator (genai appends to a batch only once): the prefix in
        one call, then a token per call through genai's cache; logits [B, L − prefix, V]."""
        rows = []
        for row in np.asarray(ids):
            generator = self._generator(1, len(row))
            generator.append_tokens(row[None, :prefix].astype(np.int32))
            steps = []
            for token in row[prefix:]:
                generator.append_tokens(np.array([[token]], dtype=np.int32))
                steps.append(np.asarray(generator.get_output("logits")).reshape(-1))
            rows.append(steps)
        return np.asarray(rows, dtype=np.float64)

    def generate(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        """genai's search on the batch of the unpadded prompts: a padded one (left padding, which its
        mask reads as a length) is left out."""
        prompt, count, eos_id = np.asarray(inputs["prompt_ids"]), inputs["max_new_tokens"], inputs["eos_id"]
        if eos_id is None:
            raise NotSupported("onnxruntime-genai's search always ends at an eos token; the case has none")
        padded = self._left_out(prompt)
        left_out = {row: padded.get(row, UNPADDED_ONLY) for row in range(len(prompt)) if (prompt[row] == self.cfg.pad_id).any()}
        rows = np.array([row not in left_out for row in range(len(prompt))])
        tokens = np.full((len(prompt), count), self.cfg.pad_id, dtype=np.int64)
        if rows.any():
            tokens[rows] = self.greedy_batch(prompt[rows], count, eos_id)
        return Partial(tokens, rows, left_out) if left_out else tokens

    def greedy_batch(self, prompt: np.ndarray, count: int, eos_id: int) -> np.ndarray:
        """genai's greedy search on a batch of unpadded prompts [B, P]: tokens [B, count] in the
        golden's convention, each row's eos kept and pad_id after it (and after genai stopped)."""
        generator = self._generator(len(prompt), prompt.shape[1] + count, eos_id)
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))
        steps = []
        while not generator.is_done():
            generator.generate_next_token()
            steps.append(np.asarray(generator.get_next_tokens()).reshape(-1))
        tokens = np.full((len(prompt), count), self.cfg.pad_id, dtype=np.int64)
        made = np.stack(steps, axis=1)[:, :count] if steps else tokens[:, :0]
        is_eos = made == eos_id
        after_eos = np.cumsum(is_eos, axis=1) - is_eos > 0  # an eos earlier in the row
        tokens[:, :made.shape[1]] = np.where(after_eos, self.cfg.pad_id, made)
        return tokens


GEMMA3_ROPE = ("the builder (onnxruntime-genai 0.18.0) fails on a Gemma 3 directory of transformers 5: its "
               "make_rope_init reads config.rope_parameters[\"rope_type\"], and Gemma3TextConfig's rope_parameters "
               "holds one entry per layer type (KeyError: 'rope_type'; tests/test_genai.py measures it)")


SMOLLM3_NOPE = ("the builder (onnxruntime-genai 0.18.0) fails on SmolLM3: for a NoPE layer it turns off the rotation "
                "inside GroupQueryAttention (use_rope_in_attn), and its make_attention_qk_rope then rotates q and k by "
                "a separate RotaryEmbedding op instead, reading a position_ids input its CPU model does not have "
                "(KeyError: 'position_ids'; tests/test_genai.py measures it): were it built, its NoPE layers would "
                "rotate")


def family_refusal(family: str) -> str:
    return f"{family}: onnxruntime-genai's builder and the spec share the {', '.join(FAMILIES)} families"


def genai_unsupported_reason(cfg: ModelConfig, family: str | None = None) -> str | None:
    """Why the builder's CPU model cannot be made for this config (of this family, where known), or None."""
    if family == "gemma3_text":
        return GEMMA3_ROPE
    if family == "smollm3":
        return SMOLLM3_NOPE
    if cfg.linear_attention is not None:
        return ("a hybrid's gated DeltaNet layers: onnxruntime-genai 0.18's builder makes Qwen3.5 from "
                "Qwen3_5ForConditionalGeneration's files only (the multimodal checkpoint's), which the writer does not "
                "write; its linear-attention graphs are not measured here")
    if cfg.d_head % HEAD_SIZE_MULTIPLE:
        return (f"head size {cfg.d_head}: onnxruntime's CPU GroupQueryAttention, which the builder writes, "
                f"needs a multiple of {HEAD_SIZE_MULTIPLE}")
    if (cfg.rotary_dim // 2) % ROTARY_PAIRS_MULTIPLE:
        return (f"{cfg.rotary_dim} rotated dimensions: the builder's GroupQueryAttention rotates inside the kernel, "
                f"whose cos/sin caches must hold a multiple of {ROTARY_PAIRS_MULTIPLE} pairs (it refuses "
                f"{cfg.rotary_dim // 2} at its first run)")
    if cfg.sliding_window is not None and family not in WINDOWED_FAMILIES:
        return (f"a sliding window of {cfg.sliding_window} keys: the builder reads which layers are windowed from "
                "config.json's layer_types, which MistralConfig and Phi3Config do not write, so it writes "
                "local_window_size -1 (no window) on every layer, and its runtime then bounds the prompt by a "
                "window-sized cache (tests/test_genai.py measures both); Gemma's files write layer_types, and "
                "Qwen's windows are not measured here")
    return None


class GenaiBackend:
    """onnxruntime-genai's builder and generator on the model of one directory (``--hf DIR``)."""

    name = "onnxruntime-genai"

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._built: Path | None = None

    def availability(self) -> str | None:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError as error:
            return (f"not installed: {error} (pip install --no-deps onnxruntime-genai-cuda: the plain "
                    "onnxruntime-genai package would pull the CPU onnxruntime in beside onnxruntime-gpu)")
        return None

    def devices(self) -> list[str]:
        # The CUDA model is another build (-e cuda). On an H200 (reports/gpu/nvidia-h200/, second run) its fp16
        # model's logits after a row's last real token were a constant, and its fp32 model did not load
        # ("Graph output (present.0.key) does not exist"): a column for it needs those causes in its rows first.
        return ["cpu"]

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype != "float32":
            return f"dtype {dtype}: the builder's CPU model is float32 (its float16 and bfloat16 models are CUDA's)"
        family = model_type(self.directory)  # a family its builder lacks is known before anything runs
        return None if family is None or family in FAMILIES else family_refusal(family)

    def supports_config(self, cfg: ModelConfig, dtype: str) -> str | None:
        return not_computed_by(cfg, "the genai column (its model built from the Hugging Face writer's directory)")

    def supports_sublayer(self, sublayer: str) -> str | None:
        if sublayer not in MODEL_CASES:
            return (f"onnxruntime-genai runs whole decoders ({', '.join(MODEL_CASES)}); its graph has no sublayer "
                    "entry points")
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> GenaiRunner:
        from importers import require_import_of

        imported = require_import_of(self.directory, cfg, params, "onnxruntime-genai")
        if imported.family not in FAMILIES:
            raise NotSupported(family_refusal(imported.family))
        reason = genai_unsupported_reason(cfg, imported.family)
        if reason:
            raise NotSupported(reason)
        if self._built is None:
            folder = Path(tempfile.mkdtemp(prefix="rosetta-genai-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            self._built = build_model(self.directory, cfg, folder)
        return GenaiRunner(self._built, cfg)
