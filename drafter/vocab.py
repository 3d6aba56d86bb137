"""The draft vocabulary: the target tokens the drafter can propose.

The most frequent target tokens at loss-masked positions of the dataset (ties broken by the
lower id, so the choice is reproducible), stored as SGLang expects: `d2t[i]` is the offset from
draft id i to its target id (target id = i + d2t[i]) and `t2d` marks the target ids that have a
draft id. Draft ids are in increasing target-id order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3d.dataset import dumpformat
from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import share_with_group

@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [target_vocab]

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0]) + self.d2t

    @property
    def size(self) -> int:
        return self.d2t.shape[0]


def from_counts(counts: torch.Tensor, size: int) -> DraftVocab:
    """The `size` most counted ids of a [target_vocab] count vector (all of them when the target
    vocabulary is not larger than `size`)."""
    vocab_size = counts.shape[0]
    size = min(size, vocab_size)
    # A stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
    target_ids = torch.sort(order).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return DraftVocab(d2t=target_ids - torch.arange(size), t2d=t2d)


def count_loss_tokens(sample_paths: Iterable[Path], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs at a loss-masked position. Reads only the ids and the
    mask of each sample, never the hidden states."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in sample_paths:
        with safe_open(str(path), framework="pt") as f:
            ids = f.get_tensor(dumpformat.INPUT_IDS).to(torch.int64)
            mask = f.get_tensor(dumpformat.LOSS_MASK).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def save(vocab: DraftVocab, folder: Path, fingerprint: str) -> None:
    path = layout.vocab_file(folder)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp),
              metadata={"manifest_fingerprint": fingerprint})
    share_with_group(tmp)
    tmp.rename(path)


def load(folder: Path, fingerprint: str) -> DraftVocab | None:
    """The vocabulary saved with this run, or None when there is none for this manifest."""
    path = layout.vocab_file(folder)
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("manifest_fingerprint") != fingerprint:
            return None
        return DraftVocab(d2t=f.get_tensor("d2t"), t2d=f.get_tensor("t2d"))
