"""A Hugging Face directory staged for a peer's own converter (onnxruntime-genai's model builder,
CTranslate2's TransformersConverter): both load a tokenizer and fail without one, and CTranslate2
writes its bos, eos and unk tokens' names into its model (null names fail its loader). A model
without a tokenizer (a randomly initialised one) gets a word-level vocabulary of its size, token
i named "t<i>", with the config's bos and eos (else the pad token) named. The cases feed token
ids, never text, so the tokenizer decides nothing the columns compute."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from spec import ModelConfig


def token_name(token: int) -> str:
    return f"t{token}"


def longrope_spelled_both_ways(config: dict) -> dict:
    """config.json as both peers' Phi-3 code reads it: rope_parameters["type"], transformers 4's
    spelling, where transformers 5 writes only "rope_type" (a KeyError in either otherwise); the
    same value under both names changes nothing transformers computes."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and parameters.get("rope_type") == "longrope" and "type" not in parameters:
        return {**config, "rope_parameters": {**parameters, "type": "longrope"}}
    return config


def float64_loaded_as_float32(config: dict) -> dict:
    """config.json with a float64 dtype (what save_pretrained writes of a float64 model) read as
    float32: the peers load a directory in its stored dtype, and neither converter takes float64
    (CTranslate2's: "float64 is not in list of supported dtypes"); their columns compute in float32,
    and the golden reads the same float32 values (the importer rounds float64 to float32)."""
    keys = [key for key in ("dtype", "torch_dtype") if config.get(key) == "float64"]
    return {**config, **dict.fromkeys(keys, "float32")} if keys else config


def as_the_peers_read(config: dict) -> dict:
    """config.json as both peers' loaders take it (longrope_spelled_both_ways, float64_loaded_as_float32)."""
    return float64_loaded_as_float32(longrope_spelled_both_ways(config))


def model_type(directory: Path) -> str | None:
    """config.json's model_type, read before anything loads (a peer's column refuses a family it
    lacks up front); None where the file or the field is missing (the load says why)."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def staged_directory(directory: Path, cfg: ModelConfig, into: Path,
                     config_for_peer: Callable[[dict], dict] = as_the_peers_read) -> Path:
    """`into`/huggingface: the directory's files linked, its config.json as `config_for_peer`
    rewrites it, and a tokenizer where the directory has none."""
    staged = into / "huggingface"
    staged.mkdir()
    for path in directory.iterdir():
        if path.name != "config.json":
            (staged / path.name).symlink_to(path.resolve())
    config = json.loads((directory / "config.json").read_text())
    (staged / "config.json").write_text(json.dumps(config_for_peer(config)))
    if not any((staged / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        def named(key: str) -> str:
            token = config.get(key)
            return token_name(token if isinstance(token, int) and 0 <= token < cfg.tgt_vocab_size else cfg.pad_id)

        words = Tokenizer(models.WordLevel({token_name(i): i for i in range(cfg.tgt_vocab_size)},
                                           unk_token=token_name(0)))
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token=token_name(0), pad_token=token_name(cfg.pad_id),
                                bos_token=named("bos_token_id"), eos_token=named("eos_token_id")).save_pretrained(staged)
    return staged
