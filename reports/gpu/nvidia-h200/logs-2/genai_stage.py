"""Here (CPU): a random transformers Llama directory, imported; onnxruntime-genai's builder run with
-e cuda at fp32 and fp16 into .device/genai/<precision>/; the canonical weights beside them."""
import shutil
import subprocess
import sys
from pathlib import Path

import transformers

from conformance.backends.staging import staged_directory
from importers import import_huggingface
from spec.weights import save_weights
from tests.test_huggingface_modern import build_checkpoint

root = Path(".device/genai")
shutil.rmtree(root, ignore_errors=True)
root.mkdir(parents=True)
config = transformers.LlamaConfig(
    vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
work = Path("/tmp/genai-stage")
shutil.rmtree(work, ignore_errors=True)
directory = build_checkpoint("llama", config, work / "hf")
imported = import_huggingface(directory)
save_weights(root / "weights.safetensors", imported.config, imported.params)
staged = staged_directory(directory, imported.config, work)
for precision in ("fp32", "fp16"):
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(staged), "-o",
               str(root / precision), "-p", precision, "-e", "cuda", "-c", str(work / "cache")]
    done = subprocess.run(command, capture_output=True, text=True)
    print(precision, done.returncode, (done.stdout + done.stderr).strip().splitlines()[-2:])
subprocess.run(["du", "-sh", str(root)])
