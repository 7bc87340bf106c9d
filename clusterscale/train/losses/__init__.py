"""Training losses (`train.loss`): what a global step minimises, given the embeddings of the step's texts.

A loss is a class registered in LOSSES (train/loss_config.py) by a module of this package: looking a loss up imports
every module here, so a new loss is one module (its class and `@LOSSES.register`) and its test. The config checks a
loss's rules when it is loaded, torch-free: a loss module imports torch (train/loss.py's math) inside its methods.
train/step.py embeds the texts, calls the loss on them (for the full dimension and each Matryoshka term), and
accumulates the gradient directly or with GradCache, so a loss is a pure function of the embeddings: a DDP step
with it equals one process on the whole batch whenever its terms are (tests/test_train_grad*.py check the built-ins).

A loss declares:
  name, doc               the train.loss value and what it computes
  needs_mined_negatives   it cannot work without train.negatives_per_query >= 1 (the config refuses otherwise)
  needs_negative_queries  the step also embeds each mined negative's own pair's query (`own_queries`)
  check(objective)        rules between its keys and the others (a ConfigError naming them)
  __call__(x, objective)  (this rank's share of the loss, its figures) from LossInputs
  chance(infonce, obj.)   its value for an encoder that cannot tell texts apart (the collapse guard's reference),
                          given InfoNCE's ln(candidates per query)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clusterscale.train.loss_config import LOSSES, LossConfig


@dataclass(frozen=True)
class LossInputs:
    """One step's embeddings (torch tensors, L2-normalised rows of this rank) and the keys that mask false
    negatives (train/loss.py's info_nce documents them). neg: the b*M mined (and labeled) negatives, M per query,
    or None; own_queries: each negative's own pair's query embedding (needs_negative_queries), or None; usable: (b*M,)
    bool, the negatives whose own query is known and is not the anchor's."""
    q: Any
    p: Any
    neg: Any = None
    own_queries: Any = None
    query_keys: Any = None
    passage_keys: Any = None
    neg_keys: Any = None
    neg_query_keys: Any = None
    usable: Any = None


class Loss:
    """A training loss (see the module's docstring): set the class attributes, implement __call__."""
    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""
    needs_mined_negatives: ClassVar[bool] = False
    needs_negative_queries: ClassVar[bool] = False

    def check(self, objective: LossConfig) -> None:
        """Refuse settings this loss cannot train with (a ConfigError naming the keys)."""

    def __call__(self, x: LossInputs, objective: LossConfig) -> tuple[Any, dict]:
        raise NotImplementedError

    def chance(self, infonce_chance: float, objective: LossConfig) -> float:
        return infonce_chance


def loss(name: str) -> Loss:
    """The registered loss `name` (an instance); an unknown name is a ConfigError naming every registered one."""
    found = LOSSES.get(name)
    return found() if isinstance(found, type) else found
