"""Every bad weights file and bad input we know of, and what each entry point does with it.

A suite that crashes or lies on odd input is worse than none, so refusals are catalogued like
the conformance cases: each entry is made fresh, handed to every entry point (the spec's loader,
the golden, torch, JAX, the onnxruntime runner, the CLI), and must be refused with the same
error class and the same message everywhere, before any framework sees it (SPEC.md §10).
``rosetta refusals`` runs the catalogue and writes docs/refusals.md.

The CLI is the floor above this package: it is handed in as ``command_line`` (the ``rosetta``
entry point, a function of the argument list returning the exit code), never imported here.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spec import ModelConfig, conformance_params, get_preset, init_params, save_weights
from spec.errors import SpecError
from spec.version import FORMAT_NAME, FORMAT_VERSION

TINY = get_preset("tiny")  # src vocabulary 96, tgt vocabulary 80, 2 + 2 layers, d_model 64
CHAR_LM = get_preset("char-lm")  # decoder-only
LEARNED = TINY.replace(positional="learned", max_len=8)  # learned positions: lengths are limited
MODELS = {"tiny": TINY, "char-lm": CHAR_LM, "learned": LEARNED}


# ---- bad weights files ------------------------------------------------------------------------

@dataclass(frozen=True)
class BadWeights:
    name: str
    what: str
    make: Callable[[Path], Path]  # writes the file into a folder, returns its path
    message: str  # a regular expression the error message must match


def _params() -> dict[str, np.ndarray]:
    return init_params(TINY, seed=0)


def weights_metadata(cfg: ModelConfig = TINY, **changes: str | None) -> dict[str, str]:
    """A weights file's metadata as save_weights writes it, with changes (None removes a key)."""
    metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "spec_version": "1.0",
                "config": cfg.to_json()}
    metadata.update(changes)
    return {key: value for key, value in metadata.items() if value is not None}


def changed_tensors(tensors: Mapping[str, np.ndarray], **changes: np.ndarray | None) -> dict[str, np.ndarray]:
    """A copy of tensors with changes: a change's name uses '__' for '.', and None removes the tensor."""
    changed = dict(tensors)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            changed.pop(name)
        else:
            changed[name] = value
    return changed


def _safetensors(metadata: Mapping[str, str] | None = None, **changes: np.ndarray | None) -> Callable[[Path], Path]:
    """A real safetensors file of tiny's tensors with changes (changed_tensors) and this metadata."""
    def make(folder: Path) -> Path:
        from safetensors.numpy import save_file

        path = folder / "bad.safetensors"
        save_file(changed_tensors(_params(), **changes), str(path), metadata=None if metadata is None else dict(metadata))
        return path
    return make


def _good(folder: Path) -> Path:
    path = folder / "bad.safetensors"
    save_weights(path, TINY, _params())
    return path


def _bytes(content: bytes) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / "bad.safetensors"
        path.write_bytes(content)
        return path
    return make


def _edited(edit: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    """A good file with its bytes edited."""
    def make(folder: Path) -> Path:
        path = _good(folder)
        path.write_bytes(edit(path.read_bytes()))
        return path
    return make


def _header_edited(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    """A good file whose JSON header is edited (the tensor bytes kept)."""
    def change(data: bytes) -> bytes:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        edit(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + data[8 + length:]
    return _edited(change)


def _flip_bit(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[-7] ^= 0x01  # a low mantissa bit: the value stays finite, only the digest can tell
    return bytes(changed)


def _first_tensor(header: dict) -> dict:
    return header[next(name for name in sorted(header) if name != "__metadata__")]


def _missing(folder: Path) -> Path:
    return folder / "missing.safetensors"


def _folder(folder: Path) -> Path:
    (folder / "weights").mkdir()
    return folder / "weights"


_W1 = "encoder__layers__0__ffn__w1__weight"
_SCALE = "decoder__layers__1__ffn_norm__scale"

BAD_WEIGHTS: list[BadWeights] = [
    BadWeights("missing_file", "the path does not exist", _missing, "does not exist"),
    BadWeights("directory", "a folder, not a file", _folder, "not a regular file"),
    BadWeights("empty_file", "zero bytes", _bytes(b""), "only 0 bytes"),
    BadWeights("two_bytes", "shorter than the 8-byte header length", _bytes(b"\x01\x02"), "only 2 bytes"),
    BadWeights("zip_file", "a zip archive (a torch .pt checkpoint)", _bytes(b"PK\x03\x04" + b"\0" * 60),
               "not a safetensors file"),
    BadWeights("pickle_file", "a pickle (never loaded)", _bytes(b"\x80\x04\x95" + b"\0" * 40 + b"."),
               "not a safetensors file"),
    BadWeights("text_file", "a text file", _bytes(b"these are not the weights you are looking for\n"),
               "not a safetensors file"),
    BadWeights("header_length_huge", "the header length points far past the end", _bytes(b"\xff" * 8 + b"{}"),
               "not a safetensors file"),
    BadWeights("header_not_json", "the header is not JSON", _bytes(struct.pack("<Q", 10) + b"{not json!"),
               "not valid JSON"),
    BadWeights("header_not_utf8", "the header is not UTF-8", _bytes(struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"),
               "not valid JSON"),
    BadWeights("header_json_array", "the header is a JSON array", _bytes(struct.pack("<Q", 6) + b"[1, 2]"),
               "not a JSON object"),
    BadWeights("header_empty_object", "a header with no tensors and no metadata",
               _bytes(struct.pack("<Q", 2) + b"{}"), "no metadata"),
    BadWeights("header_bad_offsets", "a tensor's byte range ends before it starts",
               _header_edited(lambda h: _first_tensor(h).update(data_offsets=[10, 5])), "header is corrupted"),
    BadWeights("header_entry_not_object", "a tensor entry that is not an object",
               _header_edited(lambda h: h.update({"x.weight": [1, 2]})), "header is corrupted"),
    BadWeights("header_unknown_dtype", "a tensor dtype safetensors does not know",
               _header_edited(lambda h: _first_tensor(h).update(dtype="Q9")), "safetensors could not read"),
    BadWeights("truncated_data", "the last 100 bytes cut off", _edited(lambda d: d[:-100]), "truncated"),
    BadWeights("truncated_header", "cut inside the header", _edited(lambda d: d[:50]), "truncated"),
    BadWeights("flipped_bit", "one bit of a tensor flipped after saving", _edited(_flip_bit),
               "do not match the SHA-256"),
    BadWeights("missing_tensor", "a parameter left out", _safetensors(metadata=weights_metadata(), tgt_embed__weight=None),
               "missing: tgt_embed.weight"),
    BadWeights("unexpected_tensor", "a tensor the config has no place for",
               _safetensors(metadata=weights_metadata(), extra__weight=np.zeros(3, np.float32)), "unexpected: extra.weight"),
    BadWeights("misshaped_tensor", "a norm scale of the wrong length",
               _safetensors(metadata=weights_metadata(), **{_SCALE: np.ones(32, np.float32)}),
               r"ffn_norm.scale: shape \[32\], expected \[64\]"),
    BadWeights("transposed_linear", "a Linear weight stored [out, in] (PyTorch's layout)",
               _safetensors(metadata=weights_metadata(), **{_W1: np.zeros((256, 64), np.float32)}),
               r"w1.weight: shape \[256, 64\], expected \[64, 256\]"),
    BadWeights("float64_tensor", "a tensor in float64", _safetensors(metadata=weights_metadata(), **{_SCALE: np.ones(64)}),
               "dtype float64, expected float32"),
    BadWeights("float16_tensor", "a tensor in float16",
               _safetensors(metadata=weights_metadata(), **{_SCALE: np.ones(64, np.float16)}), "dtype float16, expected float32"),
    BadWeights("int32_tensor", "a tensor of integers",
               _safetensors(metadata=weights_metadata(), **{_SCALE: np.ones(64, np.int32)}), "dtype int32, expected float32"),
    BadWeights("nan_values", "NaN in a tensor",
               _safetensors(metadata=weights_metadata(), **{_SCALE: np.full(64, np.nan, np.float32)}), "64 non-finite"),
    BadWeights("inf_values", "an infinity in a tensor",
               _safetensors(metadata=weights_metadata(), **{_SCALE: np.array([np.inf] + [1.0] * 63, np.float32)}),
               "1 non-finite"),
    BadWeights("no_metadata", "plain safetensors without our metadata", _safetensors(), "no metadata"),
    BadWeights("foreign_format", "metadata of another program",
               _safetensors(metadata=weights_metadata(format="pt")), "'format' is 'pt'"),
    BadWeights("format_version_not_integer", "format_version 'two'",
               _safetensors(metadata=weights_metadata(format_version="two")), "'format_version' is 'two'"),
    BadWeights("format_version_zero", "format_version 0", _safetensors(metadata=weights_metadata(format_version="0")),
               "not a valid version"),
    BadWeights("format_version_newer", "written by a newer release",
               _safetensors(metadata=weights_metadata(format_version=str(FORMAT_VERSION + 1))), "Upgrade transformer-rosetta"),
    BadWeights("no_config", "metadata without the config", _safetensors(metadata=weights_metadata(config=None)),
               "no 'config'"),
    BadWeights("config_not_json", "a config that is not JSON", _safetensors(metadata=weights_metadata(config="{broken")),
               "stored config is invalid.*not valid JSON"),
    BadWeights("config_invalid", "a config that cannot be built (5 heads for d_model 64)",
               _safetensors(metadata=weights_metadata(config=json.dumps({**TINY.to_dict(), "n_heads": 5}))),
               "stored config is invalid.*divisible"),
    BadWeights("config_unknown_field", "a config with a field the spec does not have",
               _safetensors(metadata=weights_metadata(config=json.dumps({**TINY.to_dict(), "n_experts": 8}))),
               "stored config is invalid.*n_experts"),
    BadWeights("config_disagrees_with_tensors", "the config says d_ff 128, the tensors have 256",
               _safetensors(metadata=weights_metadata(TINY.replace(d_ff=128))),
               r"ffn.w1.weight: shape \[64, 256\], expected \[64, 128\]"),
]


# ---- bad inputs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BadInput:
    name: str
    what: str
    model: str  # a key of MODELS
    call: str  # "forward" | "generate" | "decode_step" | "mha"
    arguments: Callable[[], dict[str, Any]]
    message: str


def _ids(batch: int, length: int, value: int = 1, dtype=np.int64) -> np.ndarray:
    return np.full((batch, length), value, dtype=dtype)


def _forward(src=None, tgt=None, **keeps) -> Callable[[], dict[str, Any]]:
    return lambda: {"src_ids": src() if callable(src) else src, "tgt_ids": tgt() if callable(tgt) else tgt, **keeps}


def _mha(x=None, context=None, mask=None) -> Callable[[], dict[str, Any]]:
    rng = np.random.default_rng(0)
    base = {"x": rng.standard_normal((2, 3, 64)).astype(np.float32),
            "context": rng.standard_normal((2, 3, 64)).astype(np.float32), "mask": None}
    given = {k: v for k, v in {"x": x, "context": context, "mask": mask}.items() if v is not None}
    return lambda: {**base, **given, "module": "encoder.layers.0.self_attn"}


SRC, TGT = _ids(2, 3), _ids(2, 3)

BAD_INPUTS: list[BadInput] = [
    BadInput("batch_mismatch", "source batch 2, target batch 3", "tiny", "forward",
             _forward(SRC, _ids(3, 3)), "batch sizes differ"),
    BadInput("float_ids", "token ids as floats", "tiny", "forward", _forward(_ids(2, 3, dtype=np.float32), TGT),
             "integer token ids"),
    BadInput("bool_ids", "token ids as booleans", "tiny", "forward", _forward(_ids(2, 3, dtype=bool), TGT),
             "integer token ids"),
    BadInput("string_ids", "token ids as strings", "tiny", "forward", _forward(np.array([["a", "b"]]), _ids(1, 2)),
             "integer token ids"),
    BadInput("rank1_ids", "ids without a batch axis", "tiny", "forward", _forward(np.ones(3, np.int64), TGT),
             "rank 2"),
    BadInput("rank3_ids", "ids with an extra axis", "tiny", "forward", _forward(_ids(2, 3)[..., None], TGT), "rank 2"),
    BadInput("empty_batch", "batch of 0", "tiny", "forward", _forward(_ids(0, 3), _ids(0, 3)), "empty batch"),
    BadInput("zero_length_source", "sequences of length 0", "tiny", "forward", _forward(_ids(2, 0), TGT),
             "zero-length"),
    BadInput("zero_length_target", "target of length 0", "tiny", "forward", _forward(SRC, _ids(2, 0)), "zero-length"),
    BadInput("source_id_past_vocabulary", "source id 96 in a 96-token vocabulary", "tiny", "forward",
             _forward(_ids(2, 3, 96), TGT), r"token id 96, outside the vocabulary \[0, 96\)"),
    BadInput("target_id_past_vocabulary", "target id 80 in an 80-token vocabulary", "tiny", "forward",
             _forward(SRC, _ids(2, 3, 80)), r"token id 80, outside the vocabulary \[0, 80\)"),
    BadInput("negative_id", "token id -1", "tiny", "forward", _forward(SRC, _ids(2, 3, -1)), "token id -1"),
    BadInput("missing_source", "an encoder-decoder called without a source", "tiny", "forward",
             _forward(None, TGT), "needs src_ids"),
    BadInput("list_not_array", "a nested Python list", "tiny", "forward", _forward([[1, 2]], _ids(1, 3)),
             "must be an array"),
    BadInput("keep_not_boolean", "a 0/1 integer keep-vector", "tiny", "forward",
             _forward(SRC, TGT, src_keep=np.ones((2, 3), np.int64)), "src_keep must be a boolean array"),
    BadInput("keep_wrong_shape", "a keep-vector shorter than its ids", "tiny", "forward",
             _forward(SRC, TGT, tgt_keep=np.ones((2, 2), bool)), r"tgt_keep must be a boolean array of shape \[2, 3\]"),
    BadInput("source_for_decoder_only", "a decoder-only model given a source", "char-lm", "forward",
             _forward(SRC, TGT), "takes no src_ids"),
    BadInput("past_learned_positions", "9 tokens, 8 learned positions", "learned", "forward",
             _forward(_ids(1, 9), _ids(1, 2)), "past the learned position table"),
    BadInput("zero_new_tokens", "max_new_tokens 0", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3), "bos_id": 1, "max_new_tokens": 0}, "positive integer"),
    BadInput("float_new_tokens", "max_new_tokens 2.0", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3), "bos_id": 1, "max_new_tokens": 2.0}, "positive integer"),
    BadInput("boolean_new_tokens", "max_new_tokens True", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3), "bos_id": 1, "max_new_tokens": True}, "positive integer"),
    BadInput("no_bos", "an encoder-decoder generating without bos_id", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3), "max_new_tokens": 2}, "needs bos_id"),
    BadInput("bos_past_vocabulary", "bos_id 80 in an 80-token vocabulary", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3), "bos_id": 80, "max_new_tokens": 2}, "needs bos_id"),
    BadInput("generate_bad_source", "a source id outside the vocabulary", "tiny", "generate",
             lambda: {"src_ids": _ids(1, 3, 99), "bos_id": 1, "max_new_tokens": 2}, "token id 99"),
    BadInput("decoder_only_without_prompt", "a decoder-only model generating from nothing", "char-lm", "generate",
             lambda: {"max_new_tokens": 2}, "generates from prompt_ids"),
    BadInput("generation_past_learned_positions", "prompt 1 + 9 new tokens, 8 learned positions", "learned",
             "generate", lambda: {"src_ids": _ids(1, 3), "bos_id": 1, "max_new_tokens": 9}, "past the learned position"),
    BadInput("step_batch_differs", "a decode step of batch 3 after a cache of batch 2", "tiny", "decode_step",
             lambda: {"batch": 2, "src_ids": SRC, "tgt_ids": _ids(3, 1)}, "differs from the cache"),
    BadInput("step_id_past_vocabulary", "a decode step with id 80", "tiny", "decode_step",
             lambda: {"batch": 2, "src_ids": SRC, "tgt_ids": _ids(2, 1, 80)}, "outside the vocabulary"),
    BadInput("additive_float_mask", "a 0/-inf float mask (polarity ambiguous)", "tiny", "mha",
             _mha(mask=np.zeros((3, 3), np.float32)), "must be a boolean keep-mask"),
    BadInput("mask_wrong_shape", "a [Q, K] mask of the wrong key length", "tiny", "mha",
             _mha(mask=np.ones((3, 4), bool)), "does not fit attention"),
    BadInput("mask_rank_5", "a mask with five axes", "tiny", "mha", _mha(mask=np.ones((1, 1, 1, 3, 3), bool)),
             "rank 1 to 4"),
    BadInput("activations_integer", "integer activations", "tiny", "mha", _mha(x=np.ones((2, 3, 64), np.int64)),
             "must be a floating-point array"),
    BadInput("activations_wrong_width", "activations of width 32 for d_model 64", "tiny", "mha",
             _mha(context=np.ones((2, 3, 32), np.float32)), r"shape \[batch, length, 64\]"),
]


# ---- running the catalogue --------------------------------------------------------------------

@dataclass
class Observation:
    case: str
    entry_point: str
    error: str  # the exception class, or "accepted" / "n/a"
    message: str
    expected: bool  # refused with a SpecError whose message matches the case's pattern


def _normalize(message: str, folder: Path) -> str:
    return " ".join(message.replace(f"{folder}/", "").replace(str(folder), "").split())


def _refusal(case: str, entry_point: str, pattern: str, call: Callable[[], Any], folder: Path) -> Observation:
    import re

    try:
        call()
    except SpecError as error:
        message = _normalize(str(error), folder)
        return Observation(case, entry_point, type(error).__name__, message, bool(re.search(pattern, message)))
    except Exception as error:  # noqa: BLE001 - an unexpected class is the finding
        return Observation(case, entry_point, type(error).__name__, _normalize(str(error), folder)[:200], False)
    return Observation(case, entry_point, "accepted", "", False)


CommandLine = Callable[[list[str]], int]  # the `rosetta` entry point: argv -> exit code


def _cli(command_line: CommandLine, argv: list[str]) -> Callable[[], None]:
    """Run the CLI; a refusal must be exit code 2 with one 'error:' line and no traceback."""
    def call() -> None:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = command_line(argv)
        text = stderr.getvalue()
        if code != 2 or "Traceback" in text:
            raise AssertionError(f"exit code {code}: {text[-300:]}")
        raise _CliRefusal(text.split("error: ", 1)[-1].strip())
    return call


class _CliRefusal(SpecError):
    """What the CLI printed for a refusal, for comparing with the library's message."""


def weights_entry_points(frameworks: tuple[str, ...] = ("torch", "jax"), *,
                         command_line: CommandLine | None = None) -> dict[str, Callable[[Path], Any]]:
    """{name: load(path)}: the spec's loader, each framework's, and, given the CLI's entry point,
    `rosetta info`, `rosetta check` and `rosetta export` on the file."""
    from spec import load_weights

    points: dict[str, Callable[[Path], Any]] = {"spec.load_weights": load_weights}
    if "torch" in frameworks:
        points["impl_torch"] = lambda path: __import__("impl_torch").Transformer.from_file(path)
    if "jax" in frameworks:
        points["impl_jax"] = lambda path: __import__("impl_jax").Transformer.from_file(path)
    if command_line is None:
        return points
    points["rosetta info"] = lambda path: _cli(command_line, ["info", str(path)])()
    points["rosetta check"] = lambda path: _cli(command_line, ["check", "--weights", str(path), "--backends",
                                                               "numpy-float32", "--quiet", "-k", "ffn-none-float32"])()
    points["rosetta export"] = lambda path: _cli(command_line, ["export", "--weights", str(path), "--out",
                                                                str(path) + ".onnx"])()
    return points


def observe_weights(frameworks: tuple[str, ...] = ("torch", "jax"), *,
                    command_line: CommandLine | None = None) -> list[Observation]:
    """Every bad weights file through every entry point of weights_entry_points (the CLI's three
    only when command_line, the `rosetta` entry point, is given)."""
    observations = []
    points = weights_entry_points(frameworks, command_line=command_line)
    for case in BAD_WEIGHTS:
        for entry_point, load in points.items():
            with tempfile.TemporaryDirectory() as folder:
                path = case.make(Path(folder))
                observations.append(_refusal(case.name, entry_point, case.message, lambda: load(path), Path(folder)))
    return observations


class _Models:
    """Each backend's model for each MODELS entry, built on first use."""

    def __init__(self):
        self.cache = {}

    def get(self, backend: str, model: str):
        key = (backend, model)
        if key not in self.cache:
            cfg = MODELS[model]
            params = conformance_params(cfg)  # the tests' weights: their ONNX exports are shared through the cache
            if backend == "golden":
                self.cache[key] = (cfg, params)
            elif backend == "torch":
                from impl_torch import Transformer
                self.cache[key] = Transformer.from_params(cfg, params)
            elif backend == "jax":
                from impl_jax import Transformer
                self.cache[key] = Transformer.from_params(cfg, params)
            else:
                from export.cache import exported
                from export.runner import OnnxTransformer
                self.cache[key] = OnnxTransformer(exported(cfg, params), device="cpu")
        return self.cache[key]


def _call_input(models: _Models, backend: str, case: BadInput) -> Callable[[], Any]:
    arguments = case.arguments()
    if backend == "golden":
        import impl_numpy as golden

        cfg, params = models.get("golden", case.model)
        if case.call == "forward":
            return lambda: golden.forward(cfg, params, arguments["src_ids"], arguments["tgt_ids"],
                                          src_keep=arguments.get("src_keep"), tgt_keep=arguments.get("tgt_keep"))
        if case.call == "generate":
            return lambda: golden.greedy_generate(cfg, params, **arguments)
        if case.call == "decode_step":
            def step():
                cast = golden.cast_params(cfg, params)
                cache = golden.start_cache(cfg, cast, arguments["batch"], arguments["src_ids"])
                return golden.decode_step(cfg, cast, cache, arguments["tgt_ids"])
            return step
        from conformance.backends.numpy_backend import NumpyRunner

        return lambda: NumpyRunner(cfg, params, "float64").run("mha", arguments)
    model = models.get(backend, case.model)
    if case.call == "forward":
        forward = model.forward if backend == "onnx" else model
        return lambda: forward(arguments["src_ids"], arguments["tgt_ids"], arguments.get("src_keep"),
                               arguments.get("tgt_keep"))
    if case.call == "generate":
        return lambda: model.greedy_generate(**arguments)
    if case.call == "decode_step":
        def step():
            batch, src = arguments["batch"], arguments["src_ids"]
            cache = model.start_cache(batch, 4, src)  # every runner's cache is preallocated (a capacity)
            return model.decode_step(cache, arguments["tgt_ids"])
        return step
    if backend == "torch":
        from conformance.backends.torch_backend import TorchRunner

        return lambda: TorchRunner(MODELS[case.model], init_params(MODELS[case.model], seed=0), "float32", "cpu",
                                   "sdpa").run("mha", arguments)
    from conformance.backends.jax_backend import JaxRunner

    return lambda: JaxRunner(MODELS[case.model], init_params(MODELS[case.model], seed=0), "float32", "cpu",
                             "sdpa").run("mha", arguments)


def applies(backend: str, case: BadInput) -> str | None:
    """None when the backend has this entry point, else why not."""
    if backend == "onnx" and case.call == "mha":
        return "an exported graph has no sublayer entry point"
    if backend == "onnx" and case.model == "learned":
        return "not exported (a test-only config)"
    return None


def observe_inputs(backends: tuple[str, ...] = ("golden", "torch", "jax", "onnx")) -> list[Observation]:
    models = _Models()
    observations = []
    with tempfile.TemporaryDirectory() as folder:
        for case in BAD_INPUTS:
            for backend in backends:
                why = applies(backend, case)
                if why:
                    observations.append(Observation(case.name, backend, "n/a", why, True))
                    continue
                observations.append(_refusal(case.name, backend, case.message, _call_input(models, backend, case),
                                             Path(folder)))
    return observations


def consistent(observations: list[Observation]) -> dict[str, list[str]]:
    """{case: [problems]} for cases accepted, refused with the wrong class or message, or refused
    differently by different entry points (the CLI must print the library's message)."""
    problems: dict[str, list[str]] = {}
    by_case: dict[str, list[Observation]] = {}
    for o in observations:
        by_case.setdefault(o.case, []).append(o)
    for case, seen in by_case.items():
        ran = [o for o in seen if o.error != "n/a"]
        for o in ran:
            if not o.expected:
                problems.setdefault(case, []).append(f"{o.entry_point}: {o.error}: {o.message or '(no error)'}")
        library = {(o.error, o.message) for o in ran if o.error != _CliRefusal.__name__}
        if len(library) > 1:
            problems.setdefault(case, []).append("entry points disagree: " + " | ".join(
                f"{o.entry_point}: {o.error}: {o.message}" for o in ran))
        messages = {message for _, message in library}
        for o in ran:
            if o.error == _CliRefusal.__name__ and messages and o.message not in messages:
                problems.setdefault(case, []).append(f"{o.entry_point} printed {o.message!r}, the library said {messages}")
    return problems


def refusal_table(weights: list[Observation], inputs: list[Observation]) -> str:
    """docs/refusals.md's tables: each case once, with the message every entry point gave."""
    lines = []
    for title, catalogue, observed in (("Bad weights files", BAD_WEIGHTS, weights), ("Bad inputs", BAD_INPUTS, inputs)):
        entry_points = list(dict.fromkeys(o.entry_point for o in observed))
        lines += [f"## {title} ({len(catalogue)})", "",
                  f"Entry points: {', '.join(entry_points)}. Each row: what the user sees from every one of them.", "",
                  "| case | what | error | message |", "|---|---|---|---|"]
        for case in catalogue:
            seen = [o for o in observed if o.case == case.name and o.error not in ("n/a", _CliRefusal.__name__)]
            first = seen[0] if seen else None
            message = (first.message if first else "").replace("|", "\\|")
            error = first.error if first else "-"
            skipped = [o.entry_point for o in observed if o.case == case.name and o.error == "n/a"]
            note = f" (not applicable: {', '.join(skipped)})" if skipped else ""
            lines.append(f"| `{case.name}` | {case.what}{note} | {error} | {message} |")
        lines.append("")
    return "\n".join(lines)


REFUSALS_PREAMBLE = """# What bad weights and bad inputs get you

Generated by `rosetta refusals --markdown docs/refusals.md` (a test keeps it current). Every case
is made fresh and handed to every entry point; each must refuse it with the same error class and
the same message, before any framework sees it, and the CLI must print that message with exit
code 2 and no traceback. Error classes: WeightsError, InputError and ConfigError are all
SpecError, a ValueError. Paths in messages are shown relative to the file's folder.

What is *accepted* is defined once, in spec/SPEC.md §10 (inputs) and §9 (the weights format):
for instance token ids of any integer dtype, sequences of any length with sinusoidal positions
(only learned positions stop at `max_len`), padding anywhere including a row that is all
padding (its attention rows are zeros, never NaN), and keep-vectors left out (then they come
from `pad_id`). One exception is an export's: a JAX-exported ONNX graph holds a table of
`max_len` positions and its runner refuses longer sequences (docs/onnx.md).

"""

ENTRY_POINTS = ("golden", "torch", "jax", "onnx")


@dataclass(frozen=True)
class RefusalRun:
    """The whole catalogue through every entry point asked for."""
    weights: list[Observation]
    inputs: list[Observation]

    @property
    def problems(self) -> dict[str, list[str]]:
        """{case: [problems]} over both catalogues (see consistent)."""
        return {**consistent(self.weights), **consistent(self.inputs)}

    def table(self) -> str:
        return refusal_table(self.weights, self.inputs)

    def page(self) -> str:
        """docs/refusals.md: the preamble and the tables."""
        return REFUSALS_PREAMBLE + self.table()


def run_catalogue(entry_points: tuple[str, ...] = ENTRY_POINTS, *,
                  command_line: CommandLine | None = None) -> RefusalRun:
    """Every bad weights file through the spec's loader, the frameworks among entry_points (torch,
    jax) and the CLI (given its entry point, command_line), and every bad input through each of
    entry_points (golden, torch, jax, onnx)."""
    unknown = [name for name in entry_points if name not in ENTRY_POINTS]
    if unknown:
        raise ValueError(f"unknown entry point(s) {', '.join(unknown)}; known: {', '.join(ENTRY_POINTS)}")
    weights = observe_weights(tuple(name for name in entry_points if name in ("torch", "jax")),
                              command_line=command_line)
    return RefusalRun(weights, observe_inputs(entry_points))
