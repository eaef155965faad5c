"""Serving the exported graphs with onnxruntime: teacher-forced logits, the encoder, decoder
steps with a KV cache that stays on the device, and batched greedy generation.

    model = OnnxTransformer("exported/", device="auto")
    tokens = model.greedy_generate(src_ids, bos_id=1, eos_id=2, max_new_tokens=20)

Providers are CUDA then CPU. onnxruntime quietly runs a session on the CPU when its CUDA
provider cannot load, and quietly assigns nodes to the CPU when CUDA has no kernel for them (and
keeps shape arithmetic there on purpose). A CUDA session is checked for both from its own
profiled first run (export.placement: shape arithmetic may stay on the CPU, compute may not) and
refused (``on_fallback="refuse"``, the default) or reported with a loud warning (``"warn"``).

One OnnxTransformer may be shared by many threads: onnxruntime sessions are safe to run
concurrently, this class keeps no per-call state, and every call makes its own IO binding.
Inputs are validated by the spec's rules (spec.inputs) before any graph runs.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import inspect
import json
import os
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from export.graphs import (DECODER_STEP, DECODER_STEP_IN_PLACE, DECODER_STEP_ROUTED, ENCODER, FORWARD, FORWARD_ROUTED,
                           cache_head_size, cache_tensors, example_inputs, in_place_unsupported_reason)
from export.onnx_model import METADATA_PREFIX, ExportError
from export.placement import PlacedNode, cpu_fallbacks, fallback_message, nodes_from_profile
from spec import ModelConfig
from spec.errors import InputError
from spec.inputs import (CacheWrites, check_cache_capacity, check_cache_room, check_decode_step, check_generation,
                         check_keep, check_model_inputs, check_source)
from spec.masks import real_tokens

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
DEVICES = ("cpu", "cuda", "auto")
FALLBACK_POLICIES = ("refuse", "warn")
OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class ProviderFallbackError(RuntimeError):
    """A CUDA session that would run all or part of its graph on the CPU provider."""


def nvidia_library_paths(site_folders: list[str], relative_paths: list[tuple[str, ...]]) -> list[str]:
    """The CUDA and cuDNN libraries onnxruntime's CUDA provider links by name (relative_paths,
    e.g. ('nvidia', 'cu13', 'lib', 'libcublas.so.13'), in loading order), found in whichever
    site folder holds them: NVIDIA's pip wheels (torch's among them) need not sit beside
    onnxruntime, and nothing puts them on the loader's path."""
    found = []
    for relative in relative_paths:
        for site in site_folders:
            path = os.path.join(site, *relative)
            if os.path.isfile(path):
                found.append(path)
                break
    return found


@functools.cache
def load_cuda_libraries() -> tuple[str, ...]:
    """Load, once and globally, the CUDA and cuDNN libraries of NVIDIA's pip wheels, so that the
    CUDA provider finds them by name (onnxruntime's own preload_dlls looks only beside its own
    package). Returns the paths loaded; one that fails to load is left to the provider's own
    error."""
    spec = importlib.util.find_spec("nvidia")
    relative_paths = getattr(ort, "_get_nvidia_dll_paths", None)  # onnxruntime's list for the CUDA it was built for
    if spec is None or not spec.submodule_search_locations or relative_paths is None:
        return ()
    sites = [os.path.dirname(os.path.normpath(folder)) for folder in spec.submodule_search_locations]
    loaded = []
    for path in nvidia_library_paths(sites, list(relative_paths(False, True, True))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            loaded.append(path)
        except OSError:
            pass
    return tuple(loaded)


def cuda_available() -> bool:
    """Whether onnxruntime's CUDA provider is built in *and* can load here (it needs a GPU and
    the CUDA libraries; listing it in get_available_providers() promises neither)."""
    if CUDA not in ort.get_available_providers() or not Path("/proc/driver/nvidia/version").exists():
        return False  # no NVIDIA driver: trying would only print onnxruntime's load errors
    load_cuda_libraries()
    probe = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]),
        opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the failed CUDA load is the answer, not a warning to print
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=[CUDA, CPU])
    except Exception:  # noqa: BLE001 - any failure to start CUDA means "not here"
        return False
    return CUDA in session.get_providers()


def profiled_session(path: str | Path | bytes, options: Mapping[str, Any], providers: list,
                     feeds: Mapping[str, np.ndarray]) -> tuple[ort.InferenceSession, list[PlacedNode]]:
    """A session (of a graph file, or a serialized graph) and where each of its nodes ran in one
    run on feeds, read from onnxruntime's profile (the only record of the real placement).
    Profiling ends with that run: the session goes on serving without it."""
    with tempfile.TemporaryDirectory() as directory:
        session = ort.InferenceSession(path if isinstance(path, bytes) else str(path), session_options(**options, profile_prefix=os.path.join(directory, "profile")),
                                       providers=providers)
        session.run(None, dict(feeds))
        events = json.loads(Path(session.end_profiling()).read_text())
    return session, nodes_from_profile(events)


def session_options(*, optimization: str, deterministic: bool, threads: int | None,
                    profile_prefix: str | None = None) -> ort.SessionOptions:
    """Explicit options. No ``session.disable_cpu_ep_fallback``: onnxruntime refuses it beside an
    explicit CPU provider, and without the CPU provider it refuses the shape arithmetic it keeps
    on the CPU on purpose (export.placement decides what counts as a fallback)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    options.use_deterministic_compute = deterministic
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = threads
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


class Sessions(MutableMapping):
    """role -> onnxruntime session, each made by make(role, file) when it is first asked for; the
    roles are those of `graphs` (role -> file) from the start. Callers on several threads share the
    one session a role gets (the lock: two first calls at once would each make one)."""

    def __init__(self, make: Callable[[str, str], ort.InferenceSession], graphs: Mapping[str, str]):
        # a bound method held weakly: its object owns these sessions, and a strong reference back
        # would be a cycle that keeps both, every session's memory with them, until the collector
        # runs (an ONNX column's 1.9 GB at SmolLM2-135M's size stayed under the next column's)
        self._make = weakref.WeakMethod(make) if inspect.ismethod(make) else (lambda: make)
        self.graphs, self.made = dict(graphs), {}
        self.making = threading.Lock()

    def __getitem__(self, role: str) -> ort.InferenceSession:
        if role not in self.graphs:
            raise KeyError(role)
        with self.making:
            if role not in self.made:
                make = self._make()
                if make is None:
                    raise ReferenceError(f"the {role!r} session's model is gone: its sessions cannot be made")
                self.made[role] = make(role, self.graphs[role])
        return self.made[role]

    def __setitem__(self, role: str, session: ort.InferenceSession) -> None:
        self.graphs.setdefault(role, "")
        self.made[role] = session

    def __delitem__(self, role: str) -> None:
        del self.graphs[role]
        self.made.pop(role, None)

    def __iter__(self):
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, role: object) -> bool:
        return role in self.graphs


@dataclass(frozen=True)
class OnnxCache:
    """The decoder's state between steps, as onnxruntime values on the session's device, for
    `capacity` positions (SPEC.md §7, a preallocated cache). past and spare are two sets of
    buffers of the same shapes, L × (key, value) [B, H, C, d_k] then the keep-vector [B, C]: a
    step reads past and writes spare, and the cache it returns has the two swapped, so a
    generation binds the same few buffers at every step (what onnxruntime's CUDA graphs need)
    and allocates nothing for its cache. cross: L × (key, value) [B, H, S, d_k]."""

    batch: int
    length: int
    past: tuple[ort.OrtValue, ...]
    spare: tuple[ort.OrtValue, ...]  # in place: the same key and value buffers as past, a keep-vector of its own
    cross: tuple[ort.OrtValue, ...] = ()
    src_keep: ort.OrtValue | None = None
    # the step writes into the buffers an older cache of the line reads: a stale branch is refused
    writes: CacheWrites = field(default_factory=CacheWrites, repr=False, compare=False)
    version: int = 0
    in_place: bool = False  # served by decoder_step_in_place, which writes K and V into past

    @property
    def capacity(self) -> int:
        return self.past[-1].shape()[1]

    def copy(self) -> "OnnxCache":
        """A cache with buffers of its own, to continue independently of this one."""
        self.writes.check(self.version)
        device = self.past[0].device_name()
        past = tuple(_buffer(value.numpy(), device) for value in self.past)
        return replace(self, past=past, spare=_spare(past, self.in_place), writes=CacheWrites(), version=0)


def _spare(past: tuple[ort.OrtValue, ...], in_place: bool) -> tuple[ort.OrtValue, ...]:
    """The buffers a step writes: new ones of past's shapes and types, or, in place, past's own
    keys and values (GroupQueryAttention writes them where it reads them) and a new keep-vector."""
    device = past[0].device_name()
    if in_place:
        return (*past[:-1], _buffer(np.zeros_like(past[-1].numpy()), device))
    return tuple(_buffer(np.zeros_like(value.numpy()), device) for value in past)


def served_graphs(graphs: Mapping[str, str], device: str) -> dict[str, str]:
    """The manifest's graphs a session is made for on the device: decoder_step_in_place on the
    CPU only (GroupQueryAttention's CUDA kernel has not met a GPU here, so a CUDA session keeps
    decoder_step, whose placement is checked)."""
    return {role: file for role, file in graphs.items() if role != DECODER_STEP_IN_PLACE or device == "cpu"}


def step_chunks(start: int, n_new: int, batch: int, in_place: bool) -> list[tuple[int, int]]:
    """The [from, to) slices of a step's n_new tokens that one graph run takes: all at once, but on
    decoder_step_in_place a chunk after position 0 for more than one row a token at a time, which
    is all onnxruntime's CPU GroupQueryAttention takes there (the logits are the same: a token
    attends only to the positions before it)."""
    if in_place and start > 0 and n_new > 1 and batch > 1:
        return [(t, t + 1) for t in range(n_new)]
    return [(0, n_new)]


def _buffer(array: np.ndarray, device: str) -> ort.OrtValue:
    """New memory on the device holding a copy of `array`. (ortvalue_from_numpy would share a
    CPU array's memory: buffers made from one array of zeros would all be one buffer.)"""
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, device.lower())
    value.update_inplace(np.ascontiguousarray(array))
    return value


def cuda_provider_options(tf32: bool = False) -> dict[str, str]:
    """The CUDA provider's options. Unless told, onnxruntime's CUDA provider rounds the inputs of
    float32 MatMul, Gemm and attention products to TF32's 10-bit mantissa (use_tf32 is on by
    default): on an H200 that put our float32 exports 2.5e-3 to 5.3e-3 from the golden, 25 to 59
    times float32's tolerance and exactly as far as torch's and JAX's TF32 columns
    (reports/gpu/nvidia-h200/). float32 is float32 here; tf32=True is the provider's default,
    checked as the TF32 column is."""
    return {"device_id": "0", "use_tf32": "1" if tf32 else "0"}


class OnnxTransformer:
    """The exported graphs of one model, loaded into onnxruntime sessions. tf32: on CUDA, let a
    float32 export's matrix products round to TF32 (onnxruntime's default; off here)."""

    def __init__(self, directory: str | Path, *, device: str = "auto", on_fallback: str = "refuse",
                 optimization: str = "all", deterministic: bool = False, threads: int | None = None,
                 tf32: bool = False):
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        if on_fallback not in FALLBACK_POLICIES:
            raise ValueError(f"on_fallback must be one of {', '.join(FALLBACK_POLICIES)}, got {on_fallback!r}")
        if optimization not in OPTIMIZATION_LEVELS:
            raise ValueError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        self.directory = Path(directory)
        manifest_path = self.directory / "manifest.json"
        if not manifest_path.is_file():
            raise ExportError(f"{self.directory} holds no manifest.json: not a directory written by `rosetta export`")
        self.manifest = json.loads(manifest_path.read_text())
        self.cfg = ModelConfig.from_json(json.dumps(self.manifest["config"]))
        self.dtype = self.manifest["dtype"]
        if device == "auto":
            device = "cuda" if cuda_available() else "cpu"
        elif device == "cuda" and not cuda_available():
            raise ProviderFallbackError(
                "device 'cuda' asked for, but onnxruntime's CUDA provider cannot run here "
                f"(available providers: {', '.join(ort.get_available_providers())}; no GPU or CUDA libraries)")
        self.device, self.on_fallback = device, on_fallback
        self.options = {"optimization": optimization, "deterministic": deterministic, "threads": threads}
        if tf32 and (device != "cuda" or self.dtype != "float32"):
            raise ValueError(f"tf32 is a CUDA matmul mode of float32 graphs; this is a {self.dtype} export on {device}")
        self.providers = [(CUDA, cuda_provider_options(tf32)), CPU] if device == "cuda" else [CPU]
        self._placements: dict[str, list[PlacedNode]] = {}  # a CUDA session's, seen at load
        self.graphs = served_graphs(self.manifest["graphs"], device)
        for role, file in self.graphs.items():
            self._check_stamp(role, file)
        # On CUDA every session is made now, as the refusal of a fallback promises (its placement is
        # seen at load); on the CPU each at its first use: each session holds its own prepacked copy
        # of the weights, and a forward-only run never needs the step graphs'
        self.sessions = Sessions(self._session, self.graphs)
        if device == "cuda":
            for role in self.graphs:
                self.sessions[role]
        self.in_place = DECODER_STEP_IN_PLACE in self.sessions

    def _check_stamp(self, role: str, file: str) -> None:
        """The graph's own stamp (its metadata, read without its weights) must be this export's."""
        path = self.directory / file
        graph = onnx.load(str(path), load_external_data=False)
        stamp = {prop.key[len(METADATA_PREFIX):]: prop.value for prop in graph.metadata_props
                 if prop.key.startswith(METADATA_PREFIX)}
        del graph
        for key in ("config", "params_sha256", "dtype"):
            expected = self.manifest[key] if key != "config" else self.cfg.to_json()
            found = stamp.get(key)
            if key == "config" and found is not None:
                found = ModelConfig.from_json(found).to_json()
            if found != expected:
                raise ExportError(f"{path.name}: its {key} metadata does not match manifest.json; "
                                  "the directory mixes graphs from different exports")
        if stamp.get("role") != role:
            raise ExportError(f"{path.name}: its metadata says role {stamp.get('role')!r}, manifest.json says {role!r}")

    def _session(self, role: str, file: str) -> ort.InferenceSession:
        path = self.directory / file
        if self.device == "cuda":
            # the serving session's own first run, profiled: where its nodes really ran
            session, self._placements[role] = profiled_session(path, self.options, self.providers,
                                                               example_inputs(self.cfg, role, self.dtype))
        else:
            session = ort.InferenceSession(str(path), session_options(**self.options), providers=self.providers)
        if self.device == "cuda":
            if CUDA not in session.get_providers():
                self._fallback(f"{path.name}: onnxruntime started the session on {session.get_providers()} only")
            elif fallbacks := cpu_fallbacks(self._placements[role]):
                self._fallback(fallback_message(path.name, fallbacks))
        return session

    def _fallback(self, message: str) -> None:
        if self.on_fallback == "refuse":
            raise ProviderFallbackError(message)
        warnings.warn(f"CUDA FALLBACK: {message}", RuntimeWarning, stacklevel=3)

    @property
    def provider_name(self) -> str:
        """The provider the sessions try first: CUDAExecutionProvider or CPUExecutionProvider."""
        first = self.providers[0]
        return first if isinstance(first, str) else first[0]

    def has(self, role: str) -> bool:
        return role in self.sessions

    @property
    def step_graph(self) -> str:
        """The graph that serves decoding here, with why it is not the in-place one where it is not:
        'decoder_step_in_place', or e.g. 'decoder_step (dtype float16: ...)'; '' without a step graph."""
        if self.in_place:
            return DECODER_STEP_IN_PLACE
        if DECODER_STEP not in self.sessions:
            return ""
        if DECODER_STEP_IN_PLACE in self.manifest["graphs"]:
            why = ("on cuda: GroupQueryAttention's CUDA kernel has not met a GPU here" if self.device == "cuda"
                   else "the in-place step is switched off")
        else:
            why = (in_place_unsupported_reason(self.dtype, self.cfg)
                   or f"the {self.manifest.get('exporter', '')} export writes none")
        return f"{DECODER_STEP} ({why})"

    def _require(self, role: str) -> ort.InferenceSession:
        if role not in self.sessions:
            raise ExportError(f"this export has no {role} graph (it has {', '.join(self.sessions)}); "
                              f"export it with `rosetta export --graphs {role}`")
        return self.sessions[role]

    # ---- inputs ----
    def _keep(self, ids: np.ndarray, keep, side: str, offset: int = 0) -> np.ndarray:
        """The given keep-vector, else ids != pad_id with an encoder-decoder's start token real."""
        if keep is None:
            return real_tokens(self.cfg, ids, side, offset)
        check_keep(keep, ids, f"{side}_keep")
        return np.asarray(keep, dtype=bool)

    def _check_length(self, length: int, name: str) -> None:
        limit = self.manifest.get("max_positions")
        if limit is not None and length > limit:
            raise InputError(f"{name}: {length} positions, but this export's graphs take at most {limit} "
                             "(a JAX export holds a position table of max_len rows)")

    def _run(self, role: str, feeds: Mapping[str, Any], into: Mapping[str, ort.OrtValue] | None = None) -> list:
        """Run a graph with IO binding: inputs may be NumPy arrays or OrtValues already on the
        device; outputs stay on the device as OrtValues, written into the buffers `into` names
        and allocated by onnxruntime for the others. Returns every output in the graph's order."""
        session = self._require(role)
        binding = session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        into = into or {}
        for output in session.get_outputs():
            if output.name in into:
                binding.bind_ortvalue_output(output.name, into[output.name])
            else:
                binding.bind_output(output.name, self.device)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    # ---- the model ----
    def forward(self, src_ids, tgt_ids, src_keep=None, tgt_keep=None) -> np.ndarray:
        """Teacher-forced logits [B, T, V] (the forward graph)."""
        return self.forward_on_device(src_ids, tgt_ids, src_keep, tgt_keep).numpy()

    def forward_on_device(self, src_ids, tgt_ids, src_keep=None, tgt_keep=None) -> ort.OrtValue:
        """The forward's logits left on the session's device; .numpy() copies them to the host."""
        cfg = self.cfg
        check_model_inputs(cfg, src_ids, tgt_ids)
        tgt_ids = np.asarray(tgt_ids, dtype=np.int64)
        self._check_length(tgt_ids.shape[1], "tgt_ids")
        feeds = {"tgt_ids": tgt_ids, "tgt_keep": self._keep(tgt_ids, tgt_keep, "tgt")}
        if cfg.has_encoder:
            src_ids = np.asarray(src_ids, dtype=np.int64)
            self._check_length(src_ids.shape[1], "src_ids")
            feeds = {"src_ids": src_ids, "src_keep": self._keep(src_ids, src_keep, "src"), **feeds}
        return self._run(FORWARD, feeds)[0]

    def forward_routed(self, tgt_ids, tgt_keep=None, forced: np.ndarray | None = None,
                       forced_weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A mixture of experts' forward (the forward_routed graph): the logits [B, T, V], each MoE
        layer's choices [L, B, T, k], its own, or `forced` [L, B, T, k] where given, and its own
        weights of those choices [L, B, T, k]; where given, `forced_weights` are the weights it
        takes (SPEC §5.14)."""
        cfg = self.cfg
        check_model_inputs(cfg, None, tgt_ids)
        tgt_ids = np.asarray(tgt_ids, dtype=np.int64)
        logits, chosen, weights = self._run(FORWARD_ROUTED, {
            "tgt_ids": tgt_ids, "tgt_keep": self._keep(tgt_ids, tgt_keep, "tgt"),
            **self._routing_feeds(tgt_ids.shape, forced, forced_weights)})
        return logits.numpy(), chosen.numpy(), weights.numpy()

    def _routing_feeds(self, shape: tuple[int, int], forced, forced_weights) -> dict[str, np.ndarray]:
        """The routed graphs' routing inputs for ids of `shape`: the forced choices and weights
        (zeros where not given), and replay, true where choices are forced."""
        cfg = self.cfg
        shape = (cfg.n_decoder_layers, *shape, cfg.moe.experts_per_token)
        for name, given in (("forced experts", forced), ("forced weights", forced_weights)):
            if given is not None and np.shape(given) != shape:
                raise InputError(f"{name} of shape {list(np.shape(given))}: this model and tgt_ids take {list(shape)}")
        if forced_weights is not None and forced is None:
            raise InputError("forced weights need the choices they weigh: give forced too")
        if forced is not None and forced_weights is None:
            raise InputError("forced choices need their weights: give forced_weights too (the golden's)")
        float_type = np.dtype(self.dtype)  # the export's float32 or float16
        return {"forced_experts": np.zeros(shape, np.int64) if forced is None else np.asarray(forced, np.int64),
                "forced_weights": np.zeros(shape, float_type) if forced_weights is None
                else np.asarray(forced_weights, float_type),
                "replay": np.array(forced is not None)}

    def encode(self, src_ids, src_keep=None) -> tuple[np.ndarray, list[np.ndarray]]:
        """memory [B, S, d] and each decoder layer's cross-attention key and value [B, H, S, d_k]."""
        _keep, memory, *cross = self._encode(src_ids, src_keep)
        return memory.numpy(), [value.numpy() for value in cross]

    def _encode(self, src_ids, src_keep, batch: int | None = None,
                into: tuple[ort.OrtValue, ...] | None = None) -> list:
        """[keep, memory, *cross]; the cross keys and values written into `into`'s buffers where given."""
        if not self.cfg.has_encoder:
            raise InputError("a decoder-only model has no encoder")
        check_source(self.cfg, src_ids, batch)
        src_ids = np.asarray(src_ids, dtype=np.int64)
        self._check_length(src_ids.shape[1], "src_ids")
        keep = self._keep(src_ids, src_keep, "src")
        cross = dict(zip(_cross_names(self.cfg), into)) if into is not None else None
        return [keep, *self._run(ENCODER, {"src_ids": src_ids, "src_keep": keep}, into=cross)]

    def start_cache(self, batch: int, capacity: int, src_ids=None, src_keep=None,
                    in_place: bool | None = None) -> OnnxCache:
        """An empty cache of `capacity` positions on the session's device; for an
        encoder-decoder the encoder graph runs once here. in_place=False: decoder_step's layout
        where the in-place step would serve (what decode_step_routed writes)."""
        cfg = self.cfg
        in_place = self.in_place if in_place is None else in_place and self.in_place
        capacity = check_cache_capacity(cfg, capacity)
        if not cfg.has_encoder and src_ids is not None:
            raise InputError("a decoder-only model takes no source: src_ids must be None")
        cross, keep = (), None
        if cfg.has_encoder:
            keep, _memory, *cross = self._encode(src_ids, src_keep, batch)
            keep = _buffer(keep, self.device)
        # zeros, not uninitialised memory: a masked position gets weight 0, and 0 × NaN is NaN
        head_size = cache_head_size(cfg, DECODER_STEP_IN_PLACE if in_place else DECODER_STEP)
        dtypes = {"float": np.float16 if self.dtype == "float16" else np.float32, "state": np.float32}
        sizes = {"batch": batch, "capacity": capacity}
        # a hybrid's linear layers start from zero windows and a zero state (SPEC §5.15)
        past = (*(_buffer(np.zeros([sizes.get(d, d) for d in tensor.dims], dtypes[tensor.kind]), self.device)
                  for tensor in cache_tensors("past", cfg, head_size)),
                _buffer(np.zeros((batch, capacity), dtype=bool), self.device))
        return OnnxCache(batch, 0, past, _spare(past, in_place), tuple(cross), keep, in_place=in_place)

    def decode_step(self, cache: OnnxCache, tgt_ids, tgt_keep=None) -> tuple[np.ndarray, OnnxCache]:
        """Feed the next tokens [B, n] after the cached ones: logits [B, n, V] and the new cache."""
        tgt_ids, keep = self._step_inputs(cache, tgt_ids, tgt_keep)
        logits = []
        for begin, end in step_chunks(cache.length, tgt_ids.shape[1], cache.batch, cache.in_place):
            outputs, cache = self._step(cache, tgt_ids[:, begin:end], keep[:, begin:end])
            logits.append(outputs[0].numpy())
        return (logits[0] if len(logits) == 1 else np.concatenate(logits, axis=1)), cache

    def decode_step_routed(self, cache: OnnxCache, tgt_ids, tgt_keep=None, forced: np.ndarray | None = None,
                           forced_weights: np.ndarray | None = None
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, OnnxCache]:
        """A mixture of experts' decode_step through decoder_step_routed: the logits [B, n, V], each
        MoE layer's choices [L, B, n, k] and its own weights of them, as forward_routed's, and the new
        cache (decoder_step's layout: start_cache(..., in_place=False))."""
        if cache.in_place:
            raise InputError("decode_step_routed writes decoder_step's cache; this one is the in-place step's: "
                             "start_cache(..., in_place=False)")
        tgt_ids, keep = self._step_inputs(cache, tgt_ids, tgt_keep)
        outputs, cache = self._step(cache, tgt_ids, keep, self._routing_feeds(tgt_ids.shape, forced, forced_weights))
        return outputs[0].numpy(), outputs[-2].numpy(), outputs[-1].numpy(), cache

    def _step_inputs(self, cache: OnnxCache, tgt_ids, tgt_keep) -> tuple[np.ndarray, np.ndarray]:
        check_decode_step(self.cfg, tgt_ids, cache.length, cache.batch)
        check_cache_room(cache.capacity, cache.length, np.shape(tgt_ids)[1])
        cache.writes.check(cache.version)
        tgt_ids = np.asarray(tgt_ids, dtype=np.int64)
        return tgt_ids, self._keep(tgt_ids, tgt_keep, "tgt", cache.length)

    def _step(self, cache: OnnxCache, tgt_ids: np.ndarray, tgt_keep: np.ndarray,
              routing: Mapping[str, np.ndarray] | None = None) -> tuple[list, OnnxCache]:
        """One run of the step graph (with routing: decoder_step_routed), reading past and writing
        spare (in place: keys and values into past); every output, the logits first."""
        cfg = self.cfg
        feeds: dict[str, Any] = {"tgt_ids": tgt_ids, "tgt_keep": tgt_keep,
                                 "start": np.array(cache.length, dtype=np.int64), "past_keep": cache.past[-1],
                                 **dict(zip(_names("past", cfg), cache.past)), **(routing or {})}
        if cfg.has_encoder:
            feeds["src_keep"] = cache.src_keep
            feeds.update(zip(_cross_names(cfg), cache.cross))
        present = dict(zip(_names("present", cfg) + ["present_keep"], cache.spare))
        role = DECODER_STEP_ROUTED if routing is not None else DECODER_STEP_IN_PLACE if cache.in_place else DECODER_STEP
        outputs = self._run(role, feeds, into=present)
        return outputs, replace(cache, length=cache.length + tgt_ids.shape[1], past=cache.spare, spare=cache.past,
                                version=cache.writes.advance(cache.version))

    def greedy_generate(self, src_ids=None, *, prompt_ids=None, bos_id: int | None = None,
                        eos_id: int | None = None, max_new_tokens: int, step=None) -> np.ndarray:
        """Greedy decoding with the KV cache on the device -> new tokens [B, max_new_tokens]
        (SPEC.md §7: finished rows are filled with pad_id; argmax ties go to the lowest id).
        step(cache, ids, keep) -> (logits, cache): another step than decode_step over decoder_step's
        cache layout (the conformance harness's routed step)."""
        cfg = self.cfg
        batch, _ = check_generation(cfg, src_ids, prompt_ids, bos_id, max_new_tokens)
        step_ids, step_keep = first_tokens(cfg, batch, prompt_ids, bos_id)
        # room for the first tokens and every generated one but the last, which is never fed back
        cache = self.start_cache(batch, step_ids.shape[1] + max_new_tokens - 1, src_ids,
                                 in_place=None if step is None else False)
        step = step or self.decode_step
        tokens = np.full((batch, max_new_tokens), cfg.pad_id, dtype=np.int64)
        finished = np.zeros(batch, dtype=bool)
        for t in range(max_new_tokens):
            logits, cache = step(cache, step_ids, step_keep)
            next_token = np.where(finished, cfg.pad_id, logits[:, -1].astype(np.float32).argmax(axis=-1))
            tokens[:, t] = next_token
            if eos_id is not None:
                finished |= next_token == eos_id
            if finished.all():
                break
            step_ids, step_keep = next_token[:, None].astype(np.int64), np.ones((batch, 1), dtype=bool)
        return tokens

    # ---- where things run ----
    def placement(self) -> dict[str, list[PlacedNode]]:
        """{role: [nodes, each with its provider and tensor types]}: a CUDA session's as seen at
        load; otherwise from one profiled run of each graph on small inputs."""
        return {role: self._placements.get(role) or profiled_session(
                    self.directory / file, self.options, self.providers, example_inputs(self.cfg, role, self.dtype))[1]
                for role, file in self.graphs.items()}


def first_tokens(cfg: ModelConfig, batch: int, prompt_ids, bos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """What a generation feeds first, and its keep-vector: the start token (an encoder-decoder), or
    the prompt, its padding not kept."""
    if cfg.has_encoder:
        return np.full((batch, 1), bos_id, dtype=np.int64), np.ones((batch, 1), dtype=bool)
    ids = np.asarray(prompt_ids, dtype=np.int64)
    return ids, ids != cfg.pad_id


def _names(prefix: str, cfg: ModelConfig) -> list[str]:
    return [tensor.name for tensor in cache_tensors(prefix, cfg)]


def _cross_names(cfg: ModelConfig) -> list[str]:
    return [f"cross.{i}.{part}" for i in range(cfg.n_decoder_layers) for part in ("key", "value")]
