"""The commands about weights files and presets: `rosetta import` (a Hugging Face model directory
into a weights file), `rosetta presets`, `rosetta init` and `rosetta info`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spec import (count_params, describe_preset, get_preset, init_params, list_presets, load_weights, params_digest,
                  save_weights)


def cmd_import(args: argparse.Namespace) -> int:
    """A Hugging Face model directory -> an ordinary weights file."""
    from importers import import_to_file

    imported = import_to_file(args.directory, args.out)
    cfg = imported.config
    print(f"imported {imported.family} from {args.directory}: {cfg.arch}, d_model {cfg.d_model}, {cfg.n_heads} heads, "
          f"{cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, vocabulary {cfg.tgt_vocab_size}, "
          f"{count_params(cfg):,} parameters")
    for note in imported.notes:
        print(f"  note: {note}")
    print(f"wrote {args.out} (sha256 {params_digest(imported.params)}); check it with "
          f"`rosetta check --weights {args.out} --hf {args.directory}`")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    for name in list_presets():
        cfg = get_preset(name)
        print(f"{name:12} {count_params(cfg):>12,} parameters  {cfg.arch}, d={cfg.d_model}, "
              f"heads={cfg.n_heads}, layers={cfg.n_encoder_layers}+{cfg.n_decoder_layers}")
        if args.verbose:
            print(f"             {describe_preset(name)}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    params = init_params(cfg, args.seed)
    save_weights(args.output, cfg, params)
    print(f"wrote {args.output}: preset {args.preset}, seed {args.seed}, {count_params(cfg):,} parameters, "
          f"sha256 {params_digest(params)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    cfg, params = load_weights(args.file)
    print(json.dumps({"config": cfg.to_dict(), "parameters": count_params(cfg), "tensors": len(params),
                      "params_sha256": params_digest(params)}, indent=1))
    return 0


def add_import(commands: argparse._SubParsersAction) -> None:
    importer = commands.add_parser("import", help="import a Hugging Face model directory (GPT-2, Marian, BART, "
                                   "Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE, Qwen3.5, "
                                   "Qwen3-Next) into a "
                                   "weights file")
    importer.add_argument("directory", type=Path, help="holds config.json and model.safetensors")
    importer.add_argument("--out", type=Path, required=True, help="the weights file to write (.safetensors)")
    importer.set_defaults(handler=cmd_import)


def add_presets(commands: argparse._SubParsersAction) -> None:
    presets = commands.add_parser("presets", help="list the presets")
    presets.add_argument("-v", "--verbose", action="store_true", help="say where each comes from")
    presets.set_defaults(handler=cmd_presets)


def add_init(commands: argparse._SubParsersAction) -> None:
    init = commands.add_parser("init", help="write a preset's deterministic weights to a file")
    init.add_argument("--preset", default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("output", type=Path)
    init.set_defaults(handler=cmd_init)


def add_info(commands: argparse._SubParsersAction) -> None:
    info = commands.add_parser("info", help="validate a weights file and show its config")
    info.add_argument("file", type=Path)
    info.set_defaults(handler=cmd_info)
