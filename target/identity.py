"""The one target-identity check. Every process that loads the target (the generator, the
transformers worker, every training rank on every node, the evaluation) and the daemon for what
the SGLang plugin reports it loaded refuse weights other than those the dataset's capture
contract was made with: a model of the same shape would pass every shape check and silently
poison the dataset or train the drafter against the wrong teacher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3d.statemachine.entry import ContractMismatch
from eagle3d.target.loading import fingerprint_file_or_folder


def require(contract: dict[str, Any], found: str, model: str) -> None:
    """Refuse `found`, the weights fingerprint of the target `model`, unless it is the
    contract's."""
    if contract.get("target_fingerprint") != found:
        raise ContractMismatch(
            f"the target {model} is not the model this dataset was captured with (weights "
            f"fingerprint {found}, the capture contract says "
            f"{contract.get('target_fingerprint')}): put that model back, or reload the daemon with "
            "it (systemctl reload eagle3d): another model is another run, in its own folders")


def check(contract: dict[str, Any], model_path: Path, model: str) -> str:
    """The weights fingerprint of the target at `model_path`, once it is the contract's; a
    ContractMismatch otherwise. Call it before loading the weights."""
    found = fingerprint_file_or_folder(model_path)
    require(contract, found, model)
    return found
