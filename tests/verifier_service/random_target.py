"""The random target's verifier and a prompt, shared by the verifier's tests of each logit adjustment."""

from __future__ import annotations

import torch

from specfleet.engine import SessionStore, load_model
from verifier_service.verifier import Verifier


def verifier(random_family) -> Verifier:
    """A fresh verifier of the random target whose sessions never stop at end of sequence."""
    made = Verifier(load_model("target", str(random_family["target"])), SessionStore(1 << 30, 100))
    made.loaded.eos_token_id = -1
    return made


def prompt() -> list[int]:
    return torch.randint(1, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()
