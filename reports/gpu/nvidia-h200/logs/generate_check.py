"""On the GPU: `rosetta generate --device cuda` (no --allow-cpu-fallback) on decoder_step exports,
its tokens against the golden's under the near-tie rule, and every graph's CPU-kept nodes."""
import json
import subprocess
import sys

import numpy as np

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from conformance.tolerance import compare_generation, tolerance
from export.cache import exported
from export.runner import OnnxTransformer
from export.placement import CPU_PROVIDER, by_provider
from spec import conformance_params, get_preset

out = sys.argv[1]
record = []
for preset, dtype in [("tiny", "float32"), ("tiny", "float16"), ("char-lm", "float16"), ("llama-tiny", "float32"),
                      ("qwen3-tiny", "float16")]:
    entry = {"preset": preset, "dtype": dtype}
    try:
        cfg = get_preset(preset)
        params = conformance_params(cfg, seed=0)
        directory = exported(cfg, params, framework="torch", dtype=dtype)
        rng = np.random.default_rng(5)
        rows = rng.integers(3, min(cfg.src_vocab_size if cfg.has_encoder else cfg.tgt_vocab_size, 60), (3, 6))
        flag = "--src" if cfg.has_encoder else "--prompt"
        argv = [sys.executable, "-m", "rosetta", "generate", str(directory), "--device", "cuda", "--max-new-tokens", "12",
                "--placement"]
        for row in rows:
            argv += [flag, " ".join(map(str, row))]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
        entry["exit"] = done.returncode
        entry["stderr"] = done.stderr[-3000:]
        if done.returncode == 0:
            tokens = np.array([[int(t) for t in line.split()] for line in done.stdout.strip().splitlines()])
            kwargs = dict(src_ids=rows, bos_id=1) if cfg.has_encoder else dict(prompt_ids=rows)
            want, logits = golden.greedy_generate(cfg, params, **kwargs, max_new_tokens=12, return_step_logits=True)
            relative = tolerance(dtype, cfg.d_ff, SUBLAYERS["generate"].depth(cfg))
            check = compare_generation(tokens, want, logits, relative, None)
            entry["tokens_equal_golden"] = bool(np.array_equal(tokens, want))
            entry["near_tie_rule"] = check.passed
            entry["note"] = check.reason
        model = OnnxTransformer(directory, device="cuda", on_fallback="warn")
        entry["placement"] = {role: {"providers": {p: len(n) for p, n in by_provider(nodes).items()},
                                     "cpu_nodes": [f"{node.name} {node.signature()}" for node in nodes
                                                   if node.provider == CPU_PROVIDER]}
                              for role, nodes in model.placement().items()}
    except Exception as error:  # noqa: BLE001
        entry["error"] = f"{type(error).__name__}: {error}"[:3000]
    record.append(entry)
    print(preset, dtype, entry.get("exit"), entry.get("near_tie_rule"), entry.get("error", "")[:200], flush=True)
    with open(out, "w") as handle:
        json.dump(record, handle, indent=1)
