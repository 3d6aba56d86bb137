"""The speculators-format export, proven by speculators' own code (vllm-project/speculators
0.9, on CPU): its `Eagle3DraftModel` loads the export and its forward, on the same inputs, gives
our drafter's logits at every draft step; any wrong field is named. vLLM reads the same files
(drafter/export_speculators.py) but cannot run here.

speculators is an optional extra (it pins a torch and a transformers of its own): without it
these tests skip."""

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("speculators", reason="speculators is not installed (docs/operations.md "
                                          "\"Serve with vLLM\" says how)")
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from eagle3d.drafter.export import export, load_export  # noqa: E402
from eagle3d.drafter.export_speculators import export_speculators  # noqa: E402
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter  # noqa: E402
from eagle3d.drafter.vocab import DraftVocab, from_counts  # noqa: E402
from eagle3d.statemachine.entry import Refusal  # noqa: E402
from tests.test_drafter_export import CFG as DEMO_CFG, CONTRACT  # noqa: E402

# speculators 0.9 calls transformers' attention with the argument 5.x renamed; that warning is
# an error in this suite for our own code only.
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
TTT_STEPS = 3
# speculators' flex-attention masks come in blocks of 128 positions.
SEQ = 128
SMALL = DraftConfig(hidden_size=64, target_hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                    max_position_embeddings=2048, vocab_size=512, draft_vocab_size=100,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def build(root: Path, cfg: DraftConfig) -> tuple[Eagle3Drafter, DraftVocab, Path]:
    """A random drafter of `cfg`'s shape exported both ways, and the target folder speculators
    reads its embedding from (the verifier: a config and the embedding, as a checkpoint holds
    them). Returns the drafter read back from SGLang's export (the reference), its vocabulary
    and the speculators export."""
    torch.manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size).bfloat16()
    model = Eagle3Drafter(cfg, embed.float())
    with torch.no_grad():  # norms away from 1, where a norm left unloaded would not show
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    vocab = from_counts(torch.randint(0, 50, (cfg.vocab_size,)), cfg.draft_vocab_size)
    verifier = root / "target"
    LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_hidden_layers=max(CONTRACT["layer_ids"]) + 3,
                num_attention_heads=cfg.num_attention_heads,
                architectures=[CONTRACT["architecture"]]).save_pretrained(verifier)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(
        cfg.hidden_size, dtype=torch.bfloat16)}, str(verifier / "model.safetensors"))
    sglang = export(model, vocab, CONTRACT, root / "export", TTT_STEPS)
    reference, _, _ = load_export(sglang, embed.float())
    return reference, vocab, export_speculators(sglang, root / "speculators", str(verifier))


def field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config[int(part)] if part.isdigit() else getattr(config, part)
    return config


def expected_fields(cfg: DraftConfig, verifier: str) -> dict[str, Any]:
    """What our drafter is, as speculators' config names it; independent of the exporter."""
    layer = "transformer_layer_config."
    return {
        # DecoderLayer: the residual stream is the unnormed feature; fc reads the captured
        # states unnormed; a draft step reads the previous output before the final norm.
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": CONTRACT["layer_ids"],
        "speculators_config.proposal_methods.0.speculative_tokens": TTT_STEPS,
        "speculators_config.verifier.name_or_path": verifier,
        "speculators_config.verifier.architectures": [CONTRACT["architecture"]],
        f"{layer}model_type": "llama", f"{layer}num_hidden_layers": 1,
        f"{layer}rope_parameters": cfg.rope_parameters,
        **{f"{layer}{k}": getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
            "hidden_act")},
    }


# vLLM's speculators reader fills these when absent, norm_before_residual with True: each must
# be in the file itself, not left to a default.
WRITTEN = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
           "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")


def config_problems(out: Path, cfg: DraftConfig) -> list[str]:
    raw = json.loads((out / "config.json").read_text())
    problems = [f"{name}: not written (vLLM would take its default)"
                for name in WRITTEN if name not in raw]
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    verifier = raw["speculators_config"]["verifier"]["name_or_path"]
    for name, want in expected_fields(cfg, verifier).items():
        got = field(config, name)
        if got != want:
            problems.append(f"{name}: {got!r}, our drafter's is {want!r}")
    return problems


def weight_problems(loaded: Eagle3DraftModel, ours: Eagle3Drafter, vocab: DraftVocab) -> list[str]:
    theirs = loaded.state_dict()
    want = {name.replace("midlayer.", "layers.0.", 1): w
            for name, w in ours.served_weights().items()}
    want |= {"d2t": vocab.d2t, "t2d": vocab.t2d, "embed_tokens.weight": ours.embed_tokens}
    return [f"{name}: speculators loaded other values" for name, w in want.items()
            if not torch.equal(theirs[name].to(w.dtype), w)]


def logit_problems(loaded: Eagle3DraftModel, ours: Eagle3Drafter) -> list[str]:
    """Each TTT step's logits, by speculators' forward (read off its lm_head) and by ours, where
    both have a next token to read."""
    torch.manual_seed(1)
    cfg = ours.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
    aux = torch.randn(1, SEQ, 3 * cfg.target_hidden_size)
    theirs: list[torch.Tensor] = []
    hook = loaded.lm_head.register_forward_hook(lambda m, i, out: theirs.append(out))
    with torch.no_grad():
        # Position t reads token t+1 (speculators' data shift); positions from 0, as ours.
        loaded(hidden_states=aux, input_ids=torch.cat([ids[:, 1:], ids[:, :1] * 0], dim=1),
               document_ids=torch.zeros_like(ids), position_ids=torch.arange(SEQ)[None],
               ttt_steps=TTT_STEPS)
        want = [ours.logits(out) for out in ours.unroll(ids, aux, TTT_STEPS)]
    hook.remove()
    problems = []
    for step, (got, expected) in enumerate(zip(theirs, want)):
        valid = SEQ - 1 - step
        diff = (got[:, :valid] - expected[:, :valid]).abs().max().item()
        if diff > 1e-5 * max(expected.abs().max().item(), 1.0):  # float32 rounding
            problems.append(f"logits of draft step {step}: off by {diff:.3g}")
    return problems


def problems(out: Path, ours: Eagle3Drafter, vocab: DraftVocab) -> list[str]:
    """Everything speculators' code reads differently from our drafter, each naming its field;
    empty when the export is faithful."""
    found = config_problems(out, ours.cfg)
    try:
        loaded = Eagle3DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    except (RuntimeError, ValueError) as exc:
        return found + [f"speculators cannot load it: {exc}"]
    # speculators marks the embedding NaN for its loader to fill from the verifier; under
    # transformers 5.25 (speculators 0.9 asks for 5.19 at most) from_pretrained leaves it
    # uninitialised memory instead, so the loader may skip it. The mark put back, speculators'
    # own loader reads it.
    with torch.no_grad():
        loaded.embed_tokens.weight.fill_(float("nan"))
    loaded.load_verifier_weights()
    return found + weight_problems(loaded, ours, vocab) + logit_problems(loaded, ours)


def test_the_demo_drafter_in_speculators_format_is_our_drafter_by_speculators_code(tmp_path):
    """The demo drafter's shape (SmolLM2-135M's, as test_drafter_export checks its SGLang
    export): speculators loads every weight where ours are and its forward gives our logits
    within float32 rounding at every draft step."""
    ours, vocab, out = build(tmp_path, DEMO_CFG)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert problems(out, ours, vocab) == []


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build(tmp_path_factory.mktemp("speculators"), SMALL)


def _set(key: str, value: Any) -> Callable[[dict, dict], None]:
    def change(config: dict, tensors: dict) -> None:
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    return change


def _drop(key: str) -> Callable[[dict, dict], None]:
    return lambda config, tensors: config.pop(key)


def _rope(config: dict, tensors: dict) -> None:
    layer = config["transformer_layer_config"]
    layer["rope_theta"] = layer["rope_parameters"]["rope_theta"] = 10000.0


def _d2t_off_by_one(config: dict, tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"] + 1


def _rename(old: str, new: str) -> Callable[[dict, dict], None]:
    return lambda config, tensors: tensors.__setitem__(new, tensors.pop(old))


# Each mistake an export could make (the peers' reported failures first), and the field the
# check must name for it.
MISTAKES = {
    "norm_before_residual": _set("norm_before_residual", True),
    "norm_before_residual left to vLLM's default": (_drop("norm_before_residual"),
                                                    "norm_before_residual"),
    "d2t": _d2t_off_by_one,
    "d2t missing": (lambda config, tensors: tensors.pop("d2t"), "d2t"),
    "eagle_aux_hidden_state_layer_ids": _set("eagle_aux_hidden_state_layer_ids", [1, 14, 26]),
    "fc_norm": _set("fc_norm", True),
    "norm_output": _set("norm_output", True),
    "norm_before_fc": _set("norm_before_fc", True),
    "draft_vocab_size": _set("draft_vocab_size", 99),
    "transformer_layer_config.rope_parameters": _rope,
    "transformer_layer_config.rms_norm_eps": _set("transformer_layer_config.rms_norm_eps", 1e-6),
    "transformer_layer_config.hidden_act": _set("transformer_layer_config.hidden_act", "gelu"),
    "transformer_layer_config.num_key_value_heads": _set(
        "transformer_layer_config.num_key_value_heads", 4),
    "speculative_tokens": lambda config, tensors: config["speculators_config"][
        "proposal_methods"][0].update(speculative_tokens=1),
    "layers.0.hidden_norm.weight": _rename("layers.0.hidden_norm.weight",
                                           "midlayer.hidden_norm.weight"),
    "lm_head.weight": _rename("lm_head.weight", "head.weight"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_wrong_field_in_the_export_is_named(small, tmp_path, mistake):
    ours, vocab, out = small
    change = MISTAKES[mistake]
    change, name = change if isinstance(change, tuple) else (change, mistake)
    wrong = tmp_path / "wrong"
    shutil.copytree(out, wrong)
    config = json.loads((wrong / "config.json").read_text())
    tensors = load_file(str(wrong / "model.safetensors"))
    change(config, tensors)
    (wrong / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(wrong / "model.safetensors"))

    found = problems(wrong, ours, vocab)
    assert any(name in p for p in found), found


def test_an_export_speculators_cannot_represent_is_refused_with_the_reason(small, tmp_path):
    ours, vocab, _ = small
    sglang = tmp_path / "export"
    export(ours, vocab, CONTRACT, sglang, TTT_STEPS)
    tensors = load_file(str(sglang / "model.safetensors"))
    tensors["fc_norm.0.weight"] = torch.ones(SMALL.hidden_size)  # EAGLE-3.1: not our drafter
    save_file(tensors, str(sglang / "model.safetensors"))
    with pytest.raises(Refusal, match="fc_norm.0.weight"):
        export_speculators(sglang, tmp_path / "out", "target")
    assert not (tmp_path / "out").exists()


def test_an_export_of_an_eagle3d_before_ttt_steps_is_refused_naming_why(small, tmp_path):
    """An export written before its config named the ttt_steps it was trained with (made by
    hand as that eagle3d wrote it) is refused with the reason, not a KeyError."""
    ours, vocab, _ = small
    sglang = tmp_path / "export"
    export(ours, vocab, CONTRACT, sglang, TTT_STEPS)
    config = json.loads((sglang / "config.json").read_text())
    del config["eagle3d"]["ttt_steps"]
    (sglang / "config.json").write_text(json.dumps(config))
    with pytest.raises(Refusal, match="does not name the ttt_steps it was trained with"):
        export_speculators(sglang, tmp_path / "out", "target")
