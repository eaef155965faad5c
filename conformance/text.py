"""Real text through a checkpoint's own tokenizer: the prompts of the text cases.

`rosetta check --hf DIR --prompt TEXT` (or `--prompts FILE`, one prompt per line) tokenizes each
prompt with DIR/tokenizer.json, as the checkpoint's own pipeline would (its special tokens
added), and the whole-model cases forward-text, decode-text and generate-text run on those ids;
forward-text_long runs one prompt of at least LONG_TEXT tokens (the prompts' text repeated
until it is that long, where none is): a long prompt caught a partial-RoPE bug that short
prompts let by in a well-known checker. The report shows each generated row decoded beside the
golden's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec import ModelConfig
from spec.errors import InputError

LONG_TEXT = 512  # tokens of the long text case at least
NEW_TOKENS = 16  # tokens generated from each prompt


@dataclass(frozen=True)
class Prompts:
    """The text cases' token ids: each prompt's, the long one's, and the end of sequence."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    long: tuple[int, ...]
    eos_id: int

    def to_json(self) -> str:
        return json.dumps({"texts": self.texts, "ids": self.ids, "long": self.long, "eos_id": self.eos_id})

    @classmethod
    def from_json(cls, text: str) -> Prompts:
        data = json.loads(text)
        return cls(tuple(data["texts"]), tuple(tuple(row) for row in data["ids"]), tuple(data["long"]), data["eos_id"])


def read_prompts_file(path: str | Path) -> list[str]:
    """The prompts of a --prompts file: one per line, blank lines left out."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--prompts {path}: cannot be read as UTF-8 text ({error})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise InputError(f"--prompts {path}: holds no prompt (one per line)")
    return prompts


def load_tokenizer(directory: str | Path):
    """The checkpoint's own tokenizer (tokenizer.json, read with the tokenizers package)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{directory} has no tokenizer.json: the text cases tokenize with the checkpoint's own "
                         "tokenizer (AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes it)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError("the text cases need the tokenizers package: pip install '.[hf]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library's own message says what is wrong with the file
        raise InputError(f"{path} cannot be read by the tokenizers package: {error}") from None


def prompts_for(cfg: ModelConfig, directory: str | Path, texts: list[str]) -> Prompts:
    """Tokenize the prompts with the directory's tokenizer, refusing what the spec cannot run."""
    if cfg.has_encoder:
        raise InputError("--prompt runs decoder-only checkpoints: an encoder-decoder's text cases (a source "
                         "sentence and its translation) are not built")
    if not texts or not all(text.strip() for text in texts):
        raise InputError("--prompt: every prompt must hold some text")
    tokenizer = load_tokenizer(directory)
    ids = [tuple(tokenizer.encode(text).ids) for text in texts]
    for number, (text, row) in enumerate(zip(texts, ids), start=1):
        if not row:
            raise InputError(f"prompt {number} ({text[:40]!r}) tokenizes to no token")
        if cfg.pad_id in row:
            raise InputError(f"prompt {number} ({text[:40]!r}) holds token {cfg.pad_id}, the model's pad_id, which "
                             "the spec reads as padding")
        if max(row) >= cfg.tgt_vocab_size:
            raise InputError(f"prompt {number} ({text[:40]!r}) holds token {max(row)}, outside the model's "
                             f"{cfg.tgt_vocab_size}-token vocabulary: is tokenizer.json this checkpoint's?")
    longest = max(len(row) for row in ids)
    if longest + NEW_TOKENS > cfg.max_len:
        raise InputError(f"the longest prompt has {longest} tokens; with {NEW_TOKENS} generated the model's "
                         f"{cfg.max_len} positions are exceeded")
    return Prompts(tuple(texts), tuple(ids), _long_prompt(cfg, tokenizer, texts, ids), _eos_id(cfg, directory))


def _long_prompt(cfg: ModelConfig, tokenizer, texts: list[str], ids: list[tuple[int, ...]]) -> tuple[int, ...]:
    """A prompt's ids where one has LONG_TEXT tokens, else the prompts' text repeated until it has."""
    if max(len(row) for row in ids) >= LONG_TEXT:
        return max(ids, key=len)
    if cfg.max_len < LONG_TEXT:
        raise InputError(f"the long text case needs {LONG_TEXT} positions; the model has {cfg.max_len}")
    joined = " ".join(texts)
    text = joined
    while len(tokenizer.encode(text).ids) < LONG_TEXT:
        text = f"{text} {joined}"
    return tuple(tokenizer.encode(text).ids)


def _eos_id(cfg: ModelConfig, directory: str | Path) -> int:
    """The checkpoint's end of sequence (generation_config.json, else config.json), its first where
    it lists several."""
    for name in ("generation_config.json", "config.json"):
        path = Path(directory) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < cfg.tgt_vocab_size:
                return eos
    raise InputError(f"{directory} names no eos_token_id inside the vocabulary (generation_config.json or "
                     "config.json): generate-text stops where the checkpoint's own generation would")


def decode_rows(directory: str | Path, rows, eos_id: int | None = None) -> list[str]:
    """Generated rows as text, by the checkpoint's tokenizer (special tokens shown), each up to
    and with its first eos_id (the padding after it is not generated text)."""
    tokenizer = load_tokenizer(directory)
    texts = []
    for row in rows:
        row = list(row)
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id) + 1]
        texts.append(tokenizer.decode(row, skip_special_tokens=False))
    return texts
