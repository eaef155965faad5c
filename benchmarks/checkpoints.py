"""`rosetta bench --checkpoint-shapes`: what a check costs on models the size of real checkpoints.

Random transformers models with the shapes of SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B (every
parameter drawn, so every one matters) are saved as Hugging Face directories, and each command
people run on such a checkpoint is timed as a separate process, with its peak memory: `rosetta
import`, the one-cell check and the default check. Memory is the peak over the run of the
proportional set size (PSS, /proc/PID/smaps_rollup) summed over the command's process tree: a
weights file mapped by several workers counts once, as it takes memory once. Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# name -> (transformers model type, config fields): the published checkpoints' shapes
SHAPES: dict[str, tuple[str, dict]] = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                                   bos_token_id=151643, eos_token_id=151643, pad_token_id=151643)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                   bos_token_id=128000, eos_token_id=128001)),
    # Isotonic/TinyMixtral-4x248M-MoE: four of TinyMistral-248M's FFNs as experts, two per token (~700M parameters)
    "tinymixtral-4x248m": ("mixtral", dict(vocab_size=32005, hidden_size=1024, intermediate_size=4096,
                                           num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32768,
                                           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                           bos_token_id=1, eos_token_id=2)),
    # one of Qwen3-30B-A3B's 48 layers (128 experts of 768, eight per token, renormalised; 32 query heads and 4
    # key-value heads of 128), its vocabulary cut from 151,936 to 32,768 so the float64 golden fits 24 GB
    "qwen3-30b-a3b-layer": ("qwen3_moe", dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                                              moe_intermediate_size=768, num_hidden_layers=1, num_attention_heads=32,
                                              num_key_value_heads=4, head_dim=128, num_experts=128,
                                              num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                                              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                              tie_word_embeddings=False, bos_token_id=32766,
                                              eos_token_id=32767)),
    # Qwen3.5-0.8B's text decoder (the published Qwen3_5ForConditionalGeneration's text_config): 18 gated
    # DeltaNet layers (16 key and 16 value heads of 128, a convolution 4 wide) and 6 gated full-attention
    # layers (8 query heads and 2 key-value heads of 256, a quarter of each rotated at θ = 10^7), tied
    "qwen3.5-0.8b": ("qwen3_5_text", dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                                          num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                          head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                          max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=10000000.0,
                                          rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.25},
                                          tie_word_embeddings=True, bos_token_id=248044, eos_token_id=248044,
                                          pad_token_id=248044)),
    # one of Qwen3-Next-80B-A3B's linear layers (gated DeltaNet: 16 key heads and 32 value heads of 128, a
    # convolution 4 wide) and its FFN (experts of 512, ten per token, renormalised, beside a shared expert of 512
    # under its sigmoid gate), the experts cut from 512 to 128 and the vocabulary from 151,936 to 32,768 so the
    # float64 golden fits 24 GB; untied
    "qwen3-next-80b-a3b-layer": ("qwen3_next", dict(vocab_size=32768, hidden_size=2048, intermediate_size=5120,
                                                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                                    num_experts=128, num_experts_per_tok=10, norm_topk_prob=True,
                                                    decoder_sparse_step=1, num_hidden_layers=1,
                                                    layer_types=["linear_attention"], num_attention_heads=16,
                                                    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                                    linear_num_value_heads=32, linear_key_head_dim=128,
                                                    linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                                    max_position_embeddings=262144, rms_norm_eps=1e-6,
                                                    rope_theta=10000000.0,
                                                    rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.25},
                                                    tie_word_embeddings=False, bos_token_id=32766,
                                                    eos_token_id=32767)),
    # one of Qwen1.5-MoE-A2.7B's 24 layers (Qwen2-MoE: 60 experts of 1408, four per token, not renormalised, beside
    # a shared expert of 5632 under its sigmoid gate; 16 heads of 128 with q/k/v biases), its vocabulary cut from
    # 151,936 to 32,768 as the other layer shapes' are; untied
    "qwen1.5-moe-a2.7b-layer": ("qwen2_moe", dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632,
                                                  moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                                  num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                                                  decoder_sparse_step=1, num_hidden_layers=1, num_attention_heads=16,
                                                  num_key_value_heads=16, max_position_embeddings=8192,
                                                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                                                  bos_token_id=32766, eos_token_id=32767)),
    # SmolLM3-3B cut to its first four layers (16 query heads and 4 key-value heads of 128, the fourth layer NoPE by
    # the default interval, θ 5e6), its 128,256-token vocabulary and tied head whole
    "smollm3-3b-4-layers": ("smollm3", dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                            max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=5000000.0,
                                            tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128012,
                                            pad_token_id=128004)),
    # two layers of OLMo 2 7B's shape (d 4096, 32 heads of 128, context 4096; d_ff 11008, θ 5e5, ε 1e-6): each
    # sublayer's output normed before the sum, q and k normed over all 4096 of their projection; its vocabulary
    # cut from 100,352 to 32,768 as the other layer shapes' are; untied
    "olmo2-7b-2-layers": ("olmo2", dict(vocab_size=32768, hidden_size=4096, intermediate_size=11008,
                                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                                        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
                                        tie_word_embeddings=False, pad_token_id=1, bos_token_id=None,
                                        eos_token_id=32767)),
    # one layer of gpt-oss-20b's shape (d 2880, 64 query heads and 8 key-value heads of 64, sinks, the first layer's
    # window of 128; 32 experts of 2880 with biases, four per token, the clamped SwiGLU at 7 and 1.702; YaRN factor
    # 32 over 4096 untruncated at θ 150000), its vocabulary cut from 201,088 to 32,768 as the other layer shapes'
    # are; untied
    "gpt-oss-20b-layer": ("gpt_oss", dict(vocab_size=32768, hidden_size=2880, intermediate_size=2880,
                                          num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=128,
                                          num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                          num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0,
                                          swiglu_alpha=1.702, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                          rope_theta=150000.0,
                                          rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False,
                                                        "original_max_position_embeddings": 4096},
                                          tie_word_embeddings=False, pad_token_id=32767, bos_token_id=32766,
                                          eos_token_id=32767)),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
           "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
# norms by 1 + weight: 0 is the identity (a published Qwen3.5's vision tower takes it too: it is not imported)
_NORM_IDENTITY = {"gemma2": 0.0, "gemma3_text": 0.0, "qwen3_5_text": 0.0, "qwen3_5": 0.0, "qwen3_next": 0.0}
_PLAIN_NORMS = ("linear_attn.norm.",)  # Qwen3.5's gated norm multiplies by its weight as it is


def _norm_identity(family: str, name: str) -> float:
    """The value of a norm's weight that scales nothing."""
    return 1.0 if any(part in name for part in _PLAIN_NORMS) else _NORM_IDENTITY.get(family, 1.0)
# the commands timed on each shape: name -> rosetta arguments after the program ({dir}, {weights} filled in)
RUNS: dict[str, list[str]] = {
    "import": ["import", "{dir}", "--out", "{weights}"],
    "one-cell": ["check", "--hf", "{dir}", "-k", "forward-none", "--backends", "torch", "--dtypes", "float32"],
    "default": ["check", "--hf", "{dir}"],  # a model this size: the plan of the default budget (10 min)
    "full": ["check", "--hf", "{dir}", "--full"],  # every cell
    # the default check told the memory its target allows (rosetta check --memory); shapes without one skip it
    "default-at-memory-target": ["check", "--hf", "{dir}", "--memory", "{memory}G"],
}


def random_checkpoint(family: str, config, directory: str | os.PathLike, seed: int = 0) -> Path:
    """A randomly initialised transformers model of the family saved to directory, every parameter
    drawn: matrices at 1/sqrt(their smaller side) (a stack of them, transformers 5's fused experts
    [E, out, in], at each one's; a shared expert's gate [1, d] at 1/sqrt(d)), norm scales about their identity (1, Gemma's 0; never it), biases
    about 0 (not 0), gpt-oss's sinks about 0 at 1."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family][1])(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():  # not the buffers: inv_freq is computed, not a weight
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if name.endswith("shared_expert_gate.weight"):  # [1, d]: at 1/sqrt(d), so σ(x·g) stays off 0 and 1
                tensor.copy_(noise * tensor.shape[-1] ** -0.5)
            elif name.endswith(".sinks"):  # gpt-oss's logit per head: at 1, so that each sink takes a real share
                tensor.copy_(noise)
            elif tensor.ndim >= 2:
                tensor.copy_(noise * min(tensor.shape[-2:]) ** -0.5)
            elif "norm" in name:
                tensor.copy_(_norm_identity(family, name) + 0.2 * noise)
            else:
                tensor.copy_(0.2 * noise)
    model.save_pretrained(directory)
    return Path(directory)


def shaped_checkpoint(shape: str, directory: str | os.PathLike) -> Path:
    """The random checkpoint of a SHAPES entry (made once: an existing directory is kept)."""
    # the bench's output is its table's lines: not transformers' "Writing model shards" bar (read
    # when it is first imported) nor torchao's warnings of its absent CUDA kernels
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from conformance.backends.transformers_backend import quiet_noisy_imports

    quiet_noisy_imports()
    import transformers

    family, fields = SHAPES[shape]
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    fields = dict(fields)
    theta = fields.pop("rope_theta")
    scaling = fields.pop("rope_scaling", None) or {"rope_type": "default"}
    config = getattr(transformers, CLASSES[family][0])(**fields, rope_parameters={**scaling, "rope_theta": theta})
    return random_checkpoint(family, config, directory)


@dataclass
class Measured:
    """One command's run: wall time, peak memory of its process tree, exit code, last words."""

    shape: str
    run: str
    command: list[str]
    seconds: float
    peak_pss_gb: float  # decimal GB, as --memory reads them and the targets are stated
    exit_code: int | None  # None: stopped at the time limit
    tail: list[str] = field(default_factory=list)


def tree_pss(pid: int) -> int:
    """Bytes of proportional set size of a process and all its descendants (0 for those gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def measure(shape: str, run: str, argv: Sequence[str], limit: float, every: float = 1.0,
            log: str | os.PathLike | None = None) -> Measured:
    """Run argv, sampling its process tree's PSS every `every` seconds (reading smaps_rollup of large
    processes costs CPU: every 0.25 s, the sampler took 30% of a core beside a SmolLM2-sized check);
    stop it after `limit`. Its
    output (stdout and stderr) goes to the file `log` where one is given."""
    start = time.perf_counter()
    with (open(log, "w+b") if log else tempfile.TemporaryFile()) as output:
        process = subprocess.Popen(list(argv), stdout=output, stderr=subprocess.STDOUT)
        peak, done = 0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_pss(process.pid))
                done.wait(every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            code: int | None = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        done.set()
        sampler.join()
        output.seek(0)
        tail = output.read().decode(errors="replace").splitlines()[-12:]
    return Measured(shape, run, list(argv), round(time.perf_counter() - start, 1), round(peak / 1e9, 2), code, tail)


def bench_checkpoints(shapes: Sequence[str], runs: Sequence[str], root: str | os.PathLike, limit: float,
                      log: Callable[[str], None] = print, logs: str | os.PathLike | None = None) -> list[Measured]:
    """Each run on each shape, one after another (nothing else should run meanwhile); each run's
    output into logs/<shape>-<run>.log where a folder is given."""
    results = []
    for shape in shapes:
        directory = shaped_checkpoint(shape, Path(root) / shape)
        weights = Path(root) / f"{shape}.safetensors"
        for run in runs:
            memory = TARGETS.get((shape, "default"), (None, None))[1]
            if "{memory}G" in RUNS[run] and memory is None:
                continue
            argv = [sys.executable, "-m", "rosetta"] + [part.format(dir=directory, weights=weights, memory=memory)
                                                        for part in RUNS[run]]
            result = measure(shape, run, argv, limit, log=Path(logs) / f"{shape}-{run}.log" if logs else None)
            ended = "stopped at the limit" if result.exit_code is None else f"exit {result.exit_code}"
            log(f"{shape} {run}: {result.seconds:.1f} s, peak {result.peak_pss_gb:.2f} GB, {ended}")
            results.append(result)
    return results


def as_dicts(results: Sequence[Measured]) -> list[dict]:
    return [asdict(result) for result in results]


# issue 38's targets on 2 cores and 24 GB: (shape, run) -> (seconds, GB or None)
TARGETS: dict[tuple[str, str], tuple[float, float | None]] = {
    ("qwen2.5-0.5b", "one-cell"): (20.0, None),
    ("smollm2-135m", "default"): (600.0, 6.0),
    ("qwen2.5-0.5b", "default"): (1200.0, 12.0),
    ("llama-3.2-1b", "default"): (1800.0, None),
    ("smollm2-135m", "default-at-memory-target"): (600.0, 6.0),
    ("qwen2.5-0.5b", "default-at-memory-target"): (1200.0, 12.0),
}


def markdown(results: Sequence[Measured], machine: dict, date: str) -> str:
    """The bench's table, each run beside its target where it has one (time and memory as ratios)."""
    lines = [f"# What a check costs at the size of real checkpoints ({date})", "",
             f"Machine: {machine.get('processor', '?')}, {os.cpu_count()} cores, Python {machine.get('python', '?')}. "
             "Random transformers models with the shapes of the published checkpoints; each command a process of "
             "its own, memory the peak PSS of its process tree.", "",
             "| shape | run | seconds | peak GB | exit | target | time / target | memory / target |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        target = TARGETS.get((result.shape, result.run))
        ended = "stopped at the limit" if result.exit_code is None else str(result.exit_code)
        if target:
            seconds, gigabytes = target
            aim = f"≤ {seconds:.0f} s" + (f", ≤ {gigabytes:.0f} GB" if gigabytes else "")
            time_ratio = f"{result.seconds / seconds:.2f}" + (" (at least)" if result.exit_code is None else "")
            memory_ratio = f"{result.peak_pss_gb / gigabytes:.2f}" if gigabytes else "-"
        else:
            aim, time_ratio, memory_ratio = "-", "-", "-"
        lines.append(f"| {result.shape} | {result.run} | {result.seconds:.1f} | {result.peak_pss_gb:.2f} | {ended} | "
                     f"{aim} | {time_ratio} | {memory_ratio} |")
    lines += ["", "Commands (rosetta …):", ""]
    lines += [f"- {run}: `rosetta {' '.join(arguments)}`" for run, arguments in RUNS.items()]
    failed = [result for result in results if result.exit_code not in (0,)]
    for result in failed:
        lines += ["", f"Last lines of {result.shape} {result.run}:", "", "```", *result.tail, "```"]
    return "\n".join(lines) + "\n"
