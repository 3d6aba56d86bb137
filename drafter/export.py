"""Export in the layout SGLang's `LlamaForCausalLMEagle3` loads (python/sglang/srt/models/
llama_eagle3.py). Its loader silently skips names it does not know, so the names here are pinned
by tests: `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. The token
embedding is not exported: SGLang shares the target's.

The trainer writes this export; `python -m eagle3d.drafter.export --format sglang|speculators`
(what `eagle3ctl export` runs) copies it, or writes it in speculators' format for vLLM
(drafter/export_speculators.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3d.target.layers import draft_config_layer_ids
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.vocab import DraftVocab
from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import fsync_dir, share_with_group
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.entry import OK, Refusal, child_main

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def sglang_config(cfg: DraftConfig, contract_layer_ids: list[int], target_architecture: str,
                  ttt_steps: int) -> dict[str, Any]:
    rope = dict(cfg.rope_parameters)
    rope_theta = rope.pop("rope_theta", 10000.0)
    # transformers 4.x (what SGLang runs on) reads rope_theta and rope_scaling; 5.x reads
    # rope_parameters. Both are written.
    rope_scaling = None if rope.get("rope_type", "default") == "default" else rope
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": dict(cfg.rope_parameters),
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        # SGLang would otherwise use the embedding as lm_head and ignore ours.
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": draft_config_layer_ids(list(contract_layer_ids),
                                                                       target_architecture),
            "use_aux_hidden_state": True,
        },
        # ttt_steps: how many draft steps training unrolled, for eval to say when a drafting
        # setting goes deeper than that.
        "eagle3d": {"contract_layer_ids": list(contract_layer_ids),
                    "target_architecture": target_architecture, "ttt_steps": ttt_steps},
    }


def export_tensors(model: Eagle3Drafter, vocab: DraftVocab) -> dict[str, torch.Tensor]:
    tensors = {name: w.to("cpu", torch.bfloat16).contiguous()
               for name, w in model.served_weights().items()}
    tensors["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = vocab.t2d.to(torch.bool).contiguous()
    return tensors


def export(model: Eagle3Drafter, vocab: DraftVocab, contract: dict[str, Any],
           out_dir: Path, ttt_steps: int) -> Path:
    """Write `out_dir` (config.json, model.safetensors) in SGLang's layout."""
    config = sglang_config(model.cfg, contract["layer_ids"], contract["architecture"], ttt_steps)
    return write_folder(Path(out_dir), config, export_tensors(model, vocab))


def write_folder(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write `out_dir` (config.json, model.safetensors) atomically: built in a temp folder and
    renamed into place, so a reader sees the old export or the new one."""
    # What a killed export left (another pid's temp or old folder): one writer exports here.
    for stale in out_dir.parent.glob(f".{out_dir.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    share_with_group(tmp / WEIGHTS)  # safetensors writes it for its owner alone: the serving
    # engine, run by an operator of the service's group, reads it
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def load_export(export_dir: Path, embed_tokens: torch.Tensor) -> tuple[Eagle3Drafter, DraftVocab,
                                                                       dict[str, Any]]:
    """The drafter back from an export (what evaluate runs, so it tests the export itself)."""
    config = json.loads((Path(export_dir) / CONFIG).read_text())
    cfg = DraftConfig(hidden_size=config["hidden_size"],
                      target_hidden_size=config["target_hidden_size"],
                      intermediate_size=config["intermediate_size"],
                      num_attention_heads=config["num_attention_heads"],
                      num_key_value_heads=config["num_key_value_heads"],
                      head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"],
                      max_position_embeddings=config["max_position_embeddings"],
                      vocab_size=config["vocab_size"],
                      draft_vocab_size=config["draft_vocab_size"],
                      rope_parameters=config["rope_parameters"], hidden_act=config["hidden_act"])
    tensors = load_file(str(Path(export_dir) / WEIGHTS))
    vocab = DraftVocab(d2t=tensors.pop("d2t"), t2d=tensors.pop("t2d"))
    model = Eagle3Drafter(cfg, embed_tokens)
    model.load_served_weights({k: v.float() for k, v in tensors.items()})
    return model.eval(), vocab, config


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=layout.EXPORT_FORMATS, required=True)
    p.add_argument("--drafter", type=Path,
                   help="the SGLang export to read (default: the current run's)")
    p.add_argument("--out", type=Path, help="the folder to write (default: the current run's "
                                            "export, export-speculators for speculators)")


def _run(cfg: Config, args: argparse.Namespace) -> int:
    source = args.drafter or layout.export_dir(cfg.paths.train_dir)
    if not (source / CONFIG).exists():
        raise Refusal(f"no exported drafter in {source}")
    if args.format == layout.SGLANG_EXPORT:
        out = args.out or source
        if out.resolve() != source.resolve():
            write_folder(out, json.loads((source / CONFIG).read_text()),
                         load_file(str(source / WEIGHTS)))
        print(f"{out}  (SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path "
              f"{out})")
        return OK
    try:
        from eagle3d.drafter.export_speculators import export_speculators, serve_hint
    except ImportError as exc:
        raise Refusal(f"the speculators format needs speculators 0.9 ({exc}); "
                      f"docs/operations.md \"Serve with vLLM\" says how to install it") from None
    out = export_speculators(source, args.out or layout.speculators_export_dir(
        cfg.paths.train_dir), str(cfg.target.model_path))
    print(f"{out}  (vLLM: {serve_hint(out)})")
    return OK


def main(argv: list[str] | None = None) -> int:
    return child_main("export", "The trained drafter in SGLang's or speculators' format.", _run,
                      argv, _arguments)


if __name__ == "__main__":
    sys.exit(main())
