"""There (GPU): does onnxruntime's CUDA graph capture take our decoder_step, and what does it buy?
paper-base float16, batch 64, a 16-token prompt, 64 greedy tokens: the runner's loop (IO binding, no
graph) against a loop over fixed device buffers with enable_cuda_graph, one gpu_graph_id per buffer
parity. Tokens compared with the runner's. argv: out.json [preset] [dtype] [batch] [device]."""
import json
import sys
import time
import traceback

import numpy as np
import onnxruntime as ort

from export.cache import exported
from export.graphs import DECODER_STEP
from export.runner import OnnxTransformer, _buffer, _names, cuda_provider_options, session_options
from spec import conformance_params, get_preset

out = sys.argv[1]
preset, dtype = (sys.argv[2] if len(sys.argv) > 2 else "paper-base"), (sys.argv[3] if len(sys.argv) > 3 else "float16")
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 64
device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
NEW, PROMPT = 64, 16
record = {"preset": preset, "dtype": dtype, "batch": batch, "new_tokens": NEW, "prompt": PROMPT, "ort": ort.__version__}


def save():
    with open(out, "w") as handle:
        json.dump(record, handle, indent=1, default=str)


cfg = get_preset(preset)
params = conformance_params(cfg, seed=0)
directory = exported(cfg, params, framework="torch", dtype=dtype)
model = OnnxTransformer(directory, device=device, on_fallback="warn")
rng = np.random.default_rng(0)
prompt = rng.integers(3, cfg.tgt_vocab_size, (batch, PROMPT))

kwargs = dict(src_ids=prompt, bos_id=1) if cfg.has_encoder else dict(prompt_ids=prompt)
model.greedy_generate(**kwargs, max_new_tokens=4)  # warm
start = time.perf_counter()
want = model.greedy_generate(**kwargs, max_new_tokens=NEW)
record["runner_tokens_per_s"] = batch * NEW / (time.perf_counter() - start)
save()


def graph_generate(session, run_options_for):
    """Prefill through the runner (no graph), then every step on fixed buffers."""
    if cfg.has_encoder:  # the source through the encoder, then the start token
        first, fed = np.full((batch, 1), 1, dtype=np.int64), 1
        cache = model.start_cache(batch, fed + NEW - 1, src_ids=prompt)
    else:
        first, fed = prompt, PROMPT
        cache = model.start_cache(batch, fed + NEW - 1)
    logits, cache = model.decode_step(cache, first)
    token = logits[:, -1].astype(np.float32).argmax(-1)
    tokens = [token]
    sets = [cache.past, cache.spare]  # parity 0 reads sets[0] (the prefill's output) and writes sets[1]
    ids = _buffer(token[:, None].astype(np.int64), device)
    keep = _buffer(np.ones((batch, 1), dtype=bool), device)
    position = _buffer(np.array(fed, dtype=np.int64), device)
    logits_buffer = _buffer(np.zeros((batch, 1, cfg.tgt_vocab_size), dtype=np.float16 if dtype == "float16" else np.float32), device)
    bindings = []
    for parity in (0, 1):
        binding = session.io_binding()
        read, write = sets[parity], sets[1 - parity]
        binding.bind_ortvalue_input("tgt_ids", ids)
        binding.bind_ortvalue_input("tgt_keep", keep)
        binding.bind_ortvalue_input("start", position)
        binding.bind_ortvalue_input("past_keep", read[-1])
        for name, value in zip(_names("past", cfg), read[:-1]):
            binding.bind_ortvalue_input(name, value)
        if cfg.has_encoder:
            binding.bind_ortvalue_input("src_keep", cache.src_keep)
            for name, value in zip(_names("cross", cfg), cache.cross):
                binding.bind_ortvalue_input(name, value)
        outputs = {o.name for o in session.get_outputs()}
        binding.bind_ortvalue_output("logits", logits_buffer)
        for name, value in zip(_names("present", cfg) + ["present_keep"], write):
            binding.bind_ortvalue_output(name, value)
        assert outputs == {"logits", *_names("present", cfg), "present_keep"}, outputs
        bindings.append(binding)
    for t in range(1, NEW):
        ids.update_inplace(tokens[-1][:, None].astype(np.int64))
        position.update_inplace(np.array(fed + t - 1, dtype=np.int64))
        parity = (t - 1) % 2
        session.run_with_iobinding(bindings[parity], run_options_for(parity))
        tokens.append(logits_buffer.numpy()[:, -1].astype(np.float32).argmax(-1))
    return np.stack(tokens, axis=1)


path = directory / model.graphs[DECODER_STEP]
for label, graph in (("fixed buffers, no graph", False), ("enable_cuda_graph", True)):
    entry = record.setdefault("loops", {}).setdefault(label, {})
    try:
        options = dict(cuda_provider_options())
        if graph:
            options["enable_cuda_graph"] = "1"
        session = ort.InferenceSession(str(path), session_options(optimization="all", deterministic=False, threads=None),
                                       providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"]
                                       if device == "cuda" else ["CPUExecutionProvider"])
        entry["providers"] = session.get_providers()

        def run_options_for(parity):
            run_options = ort.RunOptions()
            if graph:
                run_options.add_run_config_entry("gpu_graph_id", str(parity + 1))
            return run_options

        got = graph_generate(session, run_options_for)  # warm-up and capture
        entry["tokens_equal_runner"] = bool(np.array_equal(got, want))
        entry["first_difference"] = None if np.array_equal(got, want) else int(np.argmax((got != want).any(0)))
        start = time.perf_counter()
        got = graph_generate(session, run_options_for)
        entry["tokens_per_s"] = batch * NEW / (time.perf_counter() - start)
        entry["tokens_equal_runner_again"] = bool(np.array_equal(got, want))
    except Exception as error:  # noqa: BLE001
        entry["error"] = f"{type(error).__name__}: {error}"[:2000]
        entry["traceback"] = traceback.format_exc()[-2000:]
    save()
for label, entry in record["loops"].items():
    print(f"{label:26s}", {k: v for k, v in entry.items() if k != "traceback"})
print("runner tokens/s", round(record["runner_tokens_per_s"]))
