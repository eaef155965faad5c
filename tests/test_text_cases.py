"""Real text through the checkpoint's own tokenizer (conformance.text, `rosetta check --prompt`): a
Llama-shaped checkpoint with a tokenizer.json built here by the tokenizers package. The text cases
run the prompts' ids through forward, decode and generate, one long prompt through forward; the
report shows each generated row decoded beside the golden's; what the text cases cannot run is
refused with its reason; and a mistake only long positions show (RoPE positions wrapped at 256)
passes the short text and fails the long one."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import impl_torch.model  # noqa: E402
from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.cases import build_case, case_names  # noqa: E402
from conformance.harness import FAIL, PASS, plan_matrix, run_matrix  # noqa: E402
from conformance.text import LONG_TEXT, NEW_TOKENS, prompts_for, read_prompts_file  # noqa: E402
from importers import import_huggingface  # noqa: E402
from rosetta.main import main  # noqa: E402
from spec import InputError, get_preset  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing songs of rain and sun "
         "across wide green fields where old trees stand").split()
PROMPTS = ["the quick brown fox jumps over", "seven small birds sing", "old trees stand across wide green fields"]


def _tokenizer(directory) -> None:
    """A word-level tokenizer.json: <pad> 0, <s> 1, </s> 2, <unk> 3, then the words, then word31...
    up to the model's 64 (so that every generated id reads as a word); <s> put first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{word: 4 + i for i, word in enumerate(dict.fromkeys(WORDS))}}
    vocab.update({f"word{i}": i for i in range(len(vocab), 64)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("text-llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    random_checkpoint("llama", config, directory)
    _tokenizer(directory)
    return directory


def test_the_prompts_are_the_tokenizers_ids_and_the_long_one_is_long(checkpoint):
    cfg = import_huggingface(checkpoint).config
    prompts = prompts_for(cfg, checkpoint, PROMPTS)
    assert prompts.ids[0][:3] == (1, 4, 5) and len(prompts.ids[0]) == 7  # <s> the quick ... over
    assert len(prompts.long) >= LONG_TEXT and prompts.long[0] == 1 and prompts.eos_id == 2
    names = [name for name in case_names(cfg, text=True) if name[1].startswith("text")]
    assert names == [("forward", "text"), ("forward", "text_long"), ("decode", "text"), ("generate", "text")]
    assert not any(name[1].startswith("text") for name in case_names(cfg))
    generate = build_case(cfg, import_huggingface(checkpoint).params, "generate", "text", prompts=prompts)
    ids = generate.inputs["prompt_ids"]
    assert ids.shape == (3, 8) and (ids[1, :3] == cfg.pad_id).all() and ids[1, 3] == 1  # padded at the start
    assert generate.inputs["eos_id"] == 2 and generate.inputs["max_new_tokens"] == NEW_TOKENS
    forward = build_case(cfg, {}, "forward", "text", prompts=prompts)
    assert (forward.inputs["tgt_ids"][1, -3:] == cfg.pad_id).all() and forward.inputs["tgt_ids"][1, 0] == 1  # at the end


def test_rosetta_check_runs_the_text_cases_and_shows_the_generated_text(checkpoint, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{PROMPTS[1]}\n\n{PROMPTS[2]}\n")
    code = main(["check", "--hf", str(checkpoint), "--prompt", PROMPTS[0], "--prompts", str(prompts_file),
                 "--backends", "torch,numpy-float32,transformers", "--dtypes", "float32", "-k", "text",
                 "--report", str(tmp_path / "report"), "--jobs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    cells = {(cell["sublayer"], cell["mask_case"], cell["backend"]): cell for cell in report["cells"]}
    for backend in ("torch", "numpy-float32", "transformers"):
        for case in (("forward", "text"), ("forward", "text_long"), ("decode", "text"), ("generate", "text")):
            assert cells[(*case, backend)]["status"] == PASS, cells[(*case, backend)]
    text = report["generated_text"]
    assert [entry["prompt"] for entry in text] == PROMPTS
    assert set(text[0]["backends"]) == {"torch/float32/cpu", "numpy-float32/float32/cpu", "transformers/float32/cpu"}
    assert all(found["first_difference"] is None for entry in text for found in entry["backends"].values())
    assert all(entry["golden"].split() and "<pad>" not in entry["golden"] for entry in text)  # cut at its eos
    assert "generated text (generate-text):\nprompt 1: 'the quick brown fox jumps over'" in out
    assert "## Generated text (generate-text)" in (tmp_path / "report" / "report.md").read_text()


def test_positions_wrapped_at_256_pass_the_short_text_and_fail_the_long(checkpoint, monkeypatch):
    """A porter's RoPE whose position table stops at 256 (wrapping): the prompts are far shorter
    and pass; the long text reaches past it and fails."""
    original = impl_torch.model.rope_tables

    def wrapped(cfg, positions, dtype):
        return original(cfg, positions % 256, dtype)

    monkeypatch.setattr(impl_torch.model, "rope_tables", wrapped)
    imported = import_huggingface(checkpoint)
    results = run_matrix(imported.config, imported.params, plan_matrix(imported.config, ["torch"], ["float32"], ["cpu"]),
                         pattern="*text*", prompts=prompts_for(imported.config, checkpoint, PROMPTS))
    status = {f"{r.sublayer}-{r.mask_case}": r.status for r in results}
    assert status == {"forward-text": PASS, "forward-text_long": FAIL, "decode-text": PASS, "generate-text": PASS}


def test_what_the_text_cases_cannot_run_is_refused(checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((checkpoint / name).read_bytes())
    assert main(["check", "--hf", str(bare), "--prompt", "the fox", "--backends", "torch"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert main(["check", "--preset", "llama-tiny", "--prompt", "the fox"]) == 2
    assert "give --hf DIR" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(InputError, match="holds no prompt"):
        read_prompts_file(empty)
    cfg = import_huggingface(checkpoint).config
    with pytest.raises(InputError, match="pad_id"):
        prompts_for(cfg, checkpoint, ["the <pad> fox"])
    with pytest.raises(InputError, match="outside the model's 20-token vocabulary"):
        prompts_for(cfg.replace(tgt_vocab_size=20), checkpoint, ["old trees stand"])
    with pytest.raises(InputError, match="decoder-only"):
        prompts_for(get_preset("tiny"), checkpoint, ["the fox"])  # an encoder-decoder
    with pytest.raises(InputError, match="positions"):
        prompts_for(cfg.replace(max_len=12), checkpoint, ["the quick brown fox jumps over"])
