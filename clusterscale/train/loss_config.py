"""The loss's keys of the train section: InfoNCE, mined hard negatives and the CLP penalty (config only, torch-
free; the loss is train/loss.py, the step train/step.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import FRACTION, POSITIVE, ConfigError, Registry, Section, knob, zero_means

# train.loss's choices: the classes clusterscale/train/losses/'s modules register (a new one is a module there).
LOSSES = Registry("train.loss", "clusterscale.train.losses", first=("infonce", "clp"))


@dataclass
class LossConfig(Section):
    """Loss: InfoNCE, mined hard negatives and the CLP penalty."""
    section: ClassVar[str] = "train"

    temperature: float = knob(0.05, "InfoNCE temperature tau (paper: 0.02 from scratch).", bounds=POSITIVE)
    symmetric: bool = knob(False, "Add the passage->query InfoNCE term (mean of both directions).")
    negatives_per_query: int = knob(0, "Mined hard negatives added per query to the in-batch candidates "
                                       "(every rank's, masked like in-batch false negatives); 0 = off. Needs "
                                       "the output of `clusterscale mine`; costs M more passage embeddings "
                                       "per query.", bounds=zero_means("no mined negatives"))
    negatives_curriculum_steps: int = knob(0, "Easy-first: a query's mined negatives join its loss only from this "
                                              "step on; the steps before train on in-batch (random) negatives "
                                              "alone. 0 = from the first step.",
                                           bounds=zero_means("from the first step"), added=True)
    labeled_negatives_per_query: int = knob(0, "Labeled hard negatives (data.negative_column) added per query to "
                                               "the candidates: each row's first L, beside the mined ones "
                                               "(negatives_per_query); a row with fewer gets masked slots, which "
                                               "change nothing in its loss. 0 = off.",
                                            bounds=zero_means("no labeled negatives"), added=True)
    labeled_negatives_draw: str = knob("first", "Which L of a row's labeled negatives join its loss when it has "
                                                "more: 'first' (the same every epoch, best first as listed), or "
                                                "'random' (a fresh draw each epoch, seeded by train.seed, the epoch "
                                                "and the pair, as FlagEmbedding samples its `neg` list).",
                                       ("first", "random"), added=True)
    loss: str = knob("infonce", "Training loss: 'infonce', or 'clp' = (1 - clp_lambda) * InfoNCE + clp_lambda "
                                "* mean over mined negatives of 1 - cos(negative, its own pair's query) "
                                "(CLP, arXiv 2412.17364; needs negatives_per_query >= 1).", LOSSES)
    clp_lambda: float = knob(0.1, "Weight of the CLP penalty, in [0, 1) (paper: 0.1); used with loss=clp.",
                             bounds=FRACTION)
    matryoshka_dims: list = knob([], "Matryoshka: nested dimensions below the model's (e.g. [64, 128]); the loss "
                                     "adds, for each, the same loss on the first d dimensions of every embedding "
                                     "(re-normalised), and evaluate scores each (metrics_by_dim). [] = off.",
                                 added=True)
    matryoshka_weights: list = knob([], "Weight of each matryoshka_dims term (the full dimension's is 1); [] = 1 "
                                        "for each.", added=True)

    def check_rules(self) -> None:
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if not isinstance(dims, list) or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims) \
                or len(set(dims)) != len(dims):
            raise ConfigError(f"{self.key('matryoshka_dims')} must be a list of distinct positive integers (e.g. "
                              f"[64, 128]), got {dims!r}.")
        if not isinstance(weights, list) or (weights and len(weights) != len(dims)) or any(
                isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights):
            raise ConfigError(f"{self.key('matryoshka_weights')} must be [] or one non-negative number per "
                              f"{self.key('matryoshka_dims')} entry ({len(dims)}), got {weights!r}.")
        loss = LOSSES.get(self.loss)  # train/losses/: its own rules
        loss = loss() if isinstance(loss, type) else loss
        if loss.needs_mined_negatives and self.negatives_per_query < 1:
            raise ConfigError(f"{self.key('loss')}={self.loss} needs mined negatives: set "
                              f"{self.key('negatives_per_query')} >= 1 (e.g. 4) and run `clusterscale mine` before "
                              f"training.")
        loss.check(self)

    def matryoshka_terms(self) -> list[tuple[int, float]]:
        """(dimension, weight) of each nested Matryoshka term, smallest first."""
        weights = self.matryoshka_weights or [1.0] * len(self.matryoshka_dims)
        return sorted(zip(self.matryoshka_dims, (float(w) for w in weights)))

    def mined_at(self, step: int) -> bool:
        """Whether the mined negatives join the loss at `step` (the same on every rank: they stay in step)."""
        return bool(self.negatives_per_query) and step >= self.negatives_curriculum_steps
