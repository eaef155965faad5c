"""The ``ctranslate2`` column: CTranslate2's own converter and runtime on an imported checkpoint.

CTranslate2's TransformersConverter reads the Hugging Face directory through transformers and
writes its model with its own loader per family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
Phi-3); its Generator runs it at float32 on the CPU. Nothing of ours is in between: a loader that
leaves a feature out shows as a failing column, and conformance/diagnosis/explain.py names what it left out.
The whole-model cases its API can express are checked against the golden:
- forward: ``Generator.forward_batch``, the prompt's logits at every position in one call;
- decode: its search constrained to the given tokens (``include_prompt_in_result=True``, which
  feeds them one per step through its cache) with ``return_logits_vocab``: each step's logits,
  those from the case's prefix on compared (it feeds the prefix a token at a time too);
- generate: its greedy search (``generate_batch``, beam 1, top-1) on the unpadded prompts, the
  prompt forwarded at once, then one token per step through its cache.

What it cannot compute the spec's way is left out, row by row, with the cause (adapter.Partial):
- its rows are lengths: a row is read to its last real token, so a pad before a real token
  (left padding) cannot be masked, and the positions after a row's last real token, which the spec
  also defines, are not computed (the real positions before them are causal, and equal);
- with a sliding window, forward_batch refuses a prompt longer than the window (measured:
  "buffer to copy is of size 5 but current storage size is 4" with W = 4), while its cached steps
  (decode, generate) go past the window as the spec does.
Refused by name, each measured in tests/test_ctranslate2.py: Phi-3 (its loader reads an attribute
transformers 5 removed), rope scalings its converter does not implement (YaRN: its own message),
and the families it has no loader for. Measured failures, each explained by the omissions its
loader makes (docs/huggingface.md): Llama 3's rope scaling, Gemma 2's softcaps and query scalar,
Gemma 3's rope scaling.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from conformance.adapter import NotSupported, Partial
from conformance.backends.staging import model_type, staged_directory, token_name
from spec import ModelConfig
from spec.config import not_computed_by

MODEL_CASES = ("forward", "decode", "generate")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")  # its loaders' and the spec's
PHI3_LOADER = ("CTranslate2 4.8's Phi-3 loader reads rope_scaling[\"type\"] (staged beside rope_type) and then each "
               "layer's self_attn.rotary_emb, which transformers 5's Phi3Attention no longer has (AttributeError "
               "when converting; tests/test_ctranslate2.py measures it)")
INNER_PAD = ("CTranslate2 reads each row as a length: a pad before a real token (left padding) is attended as a "
             "token; the spec masks each pad where it stands (SPEC §5.2)")
AFTER_LAST = ("the positions after the row's last real token are not computed by CTranslate2, whose rows are "
              "lengths; the spec defines them too (SPEC §5.2)")
ALL_PAD = "a row with no real token is a length of 0 to CTranslate2; the spec defines that row's numbers (SPEC §5.2)"
PAST_WINDOW = ("with a sliding window, CTranslate2's forward_batch refuses a prompt longer than the window (\"buffer "
               "to copy is of size L but current storage size is W\"); its cached steps (the decode and generate cases) "
               "go past the window")
PADDED_PROMPT = ("a padded prompt is a shorter prompt to CTranslate2's search, which continues after its last real "
                 "token; the spec generates after the pads (SPEC §7): the column gives the search unpadded prompts only")


class CTranslate2Runner:
    def __init__(self, model_directory: Path, cfg: ModelConfig, compute_type: str = "float32"):
        import ctranslate2

        self.cfg = cfg
        self.generator = ctranslate2.Generator(str(model_directory), device="cpu", compute_type=compute_type)

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        if sublayer not in MODEL_CASES:
            raise NotSupported(f"CTranslate2's Generator runs whole decoders ({', '.join(MODEL_CASES)}), not {sublayer}")
        return getattr(self, sublayer)(inputs)

    def _row_reason(self, keep: np.ndarray) -> str | None:
        """Why a row whose real tokens are `keep` [L] cannot be fed as a length, or None."""
        if not keep.any():
            return ALL_PAD
        length = int(np.flatnonzero(keep)[-1]) + 1
        if not keep[:length].all():
            return INNER_PAD
        return None

    def _lengths(self, ids: np.ndarray, longest: int | None = None) -> tuple[np.ndarray, dict[int, str]]:
        """Each row's length as CTranslate2 reads it (0 where the row is left out) and the rows left
        out or cut short, with why; a row longer than `longest` is left out (PAST_WINDOW)."""
        keep = ids != self.cfg.pad_id
        lengths, left_out = keep.sum(axis=1), {}
        for row in range(len(ids)):
            why = self._row_reason(keep[row])
            if why is None and longest is not None and lengths[row] > longest:
                why = PAST_WINDOW
            if why is not None:
                lengths[row], left_out[row] = 0, why
            elif not keep[row].all():
                left_out[row] = AFTER_LAST
        return lengths, left_out

    def forward(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        ids = np.asarray(inputs["tgt_ids"])
        lengths, left_out = self._lengths(ids, self.cfg.sliding_window)
        computed = np.arange(ids.shape[1]) < lengths[:, None]  # [B, L]
        logits = np.full((*ids.shape, self.cfg.tgt_vocab_size), np.nan)
        rows = np.flatnonzero(lengths)
        # with a window, rows of different lengths in one call fail ("Length mask has size 112 which is
        # different than the current batch size 32", measured): such a model's rows go one per call
        batches = [[row] for row in rows] if self.cfg.sliding_window is not None else [list(rows)] if rows.size else []
        for batch in batches:
            found = self.generator.forward_batch([[int(t) for t in ids[row, :lengths[row]]] for row in batch])
            found = np.asarray(found, dtype=np.float64)  # [rows, longest, V'], each row to its own length
            if found.shape[-1] != logits.shape[-1]:
                raise ValueError(f"CTranslate2's logits have {found.shape[-1]} entries per position, the model's "
                                 f"vocabulary {logits.shape[-1]}")
            for at, row in enumerate(batch):
                logits[row, :lengths[row]] = found[at, :lengths[row]]
        return Partial(logits, computed, left_out, "position") if left_out else logits

    def decode(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        """Each row through its cache a token at a time, to its last real token: the steps from
        the prefix on are compared."""
        ids, prefix = np.asarray(inputs["tgt_ids"]), inputs["prefix"]
        lengths, left_out = self._lengths(ids)
        steps = prefix + np.arange(ids.shape[1] - prefix) < lengths[:, None]  # [B, L − prefix]
        logits = np.full((*steps.shape, self.cfg.tgt_vocab_size), np.nan)
        for row in np.flatnonzero(lengths > prefix):
            logits[row, :lengths[row] - prefix] = self.step_logits(ids[row, :lengths[row]])[prefix:]
        return Partial(logits, steps, left_out) if left_out else logits

    def step_logits(self, tokens: np.ndarray) -> np.ndarray:
        """The logits [L, V] at each of a row's L positions, its tokens fed one per step through
        the cache (the search constrained to them), nothing ending it."""
        (result,) = self.generator.generate_batch(
            [[token_name(int(t)) for t in tokens]], beam_size=1, sampling_topk=1, max_length=len(tokens),
            include_prompt_in_result=True, return_logits_vocab=True, end_token=[])
        found = np.stack([np.asarray(step, dtype=np.float64).reshape(-1) for step in result.logits[0]])
        if len(found) < len(tokens):
            raise ValueError(f"CTranslate2 gave the logits of {len(found)} steps for {len(tokens)} tokens")
        return found[:len(tokens)]

    def generate(self, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        prompt, count, eos_id = np.asarray(inputs["prompt_ids"]), inputs["max_new_tokens"], inputs["eos_id"]
        left_out = {row: self._row_reason(prompt[row] != self.cfg.pad_id) or PADDED_PROMPT
                    for row in range(len(prompt)) if (prompt[row] == self.cfg.pad_id).any()}
        rows = np.array([row not in left_out for row in range(len(prompt))])
        tokens = np.full((len(prompt), count), self.cfg.pad_id, dtype=np.int64)
        if rows.any():
            tokens[rows] = self.greedy_batch(prompt[rows], count, eos_id)
        return Partial(tokens, rows, left_out) if left_out else tokens

    def greedy_batch(self, prompt: np.ndarray, count: int, eos_id: int | None) -> np.ndarray:
        """Its greedy search on unpadded prompts [B, P]: tokens [B, count] in the golden's
        convention, each row's eos kept and pad_id after it. Without an eos_id nothing ends a row
        (an empty end_token list; None would end at the model's own eos)."""
        results = self.generator.generate_batch(
            [[token_name(int(t)) for t in row] for row in prompt], beam_size=1, sampling_topk=1, max_length=count,
            include_prompt_in_result=False, end_token=[] if eos_id is None else [int(eos_id)], return_end_token=True)
        tokens = np.full((len(prompt), count), self.cfg.pad_id, dtype=np.int64)
        for row, result in enumerate(results):
            made = list(result.sequences_ids[0])[:count]
            tokens[row, :len(made)] = made
        return tokens


def convert_model(directory: Path, cfg: ModelConfig, into: Path) -> Path:
    """CTranslate2's TransformersConverter on the directory (as stored: float32 here); the output
    folder. What its converter does not implement is NotSupported with its own message."""
    from ctranslate2.converters import TransformersConverter

    staged = staged_directory(directory, cfg, into)
    try:
        return Path(TransformersConverter(str(staged)).convert(str(into / "model"), force=True))
    except NotImplementedError as error:
        raise NotSupported(f"CTranslate2's converter: {error}") from None


def ctranslate2_unsupported_reason(family: str) -> str | None:
    if family == "phi3":
        return PHI3_LOADER
    if family not in FAMILIES:
        return f"{family}: CTranslate2's converter and the spec share the {', '.join(FAMILIES)} families"
    return None


class CTranslate2Backend:
    """CTranslate2's converter and Generator on the model of one directory (``--hf DIR``)."""

    name = "ctranslate2"

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._converted: Path | None = None

    def availability(self) -> str | None:
        try:
            import ctranslate2  # noqa: F401
        except ImportError as error:
            return f"not installed: {error} (pip install ctranslate2)"
        return None

    def devices(self) -> list[str]:
        return ["cpu"]  # its CUDA runtime has not met a GPU here

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype != "float32":
            return f"dtype {dtype}: the column runs CTranslate2's float32 compute type (its int8 is issue 41's)"
        family = model_type(self.directory)  # a family its converter lacks is known before anything runs
        return None if family is None else ctranslate2_unsupported_reason(family)

    def supports_config(self, cfg: ModelConfig, dtype: str) -> str | None:
        return not_computed_by(cfg, "the ctranslate2 column (its model converted from the Hugging Face writer's)")

    def supports_sublayer(self, sublayer: str) -> str | None:
        if sublayer not in MODEL_CASES:
            return f"CTranslate2 runs whole decoders ({', '.join(MODEL_CASES)}); it has no sublayer entry points"
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> CTranslate2Runner:
        from importers import require_import_of

        imported = require_import_of(self.directory, cfg, params, "ctranslate2")
        if (reason := ctranslate2_unsupported_reason(imported.family)) is not None:
            raise NotSupported(reason)
        if self._converted is None:
            folder = Path(tempfile.mkdtemp(prefix="rosetta-ctranslate2-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            self._converted = convert_model(self.directory, cfg, folder)
        return CTranslate2Runner(self._converted, cfg)
