"""The student model's keys of the train section: its weights, pooling, tokenizer, token limits and from-scratch
shape (config only, torch-free; the model is modeling/student.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import POSITIVE, ConfigError, Section, knob


@dataclass
class StudentConfig(Section):
    """Student model: its weights, pooling, tokenizer, token limits and from-scratch shape."""
    section: ClassVar[str] = "train"

    init: str = knob("bundled", "Student weights: 'bundled', an HF id or folder to fine-tune, or "
                                "'scratch' (random BERT of the scratch_* shape).")
    pooling: str = knob("auto", "Student pooling; 'auto' = the init model's own, mean from scratch (the paper "
                                 "uses CLS, which collapsed from scratch in every setting measured: "
                                 "benchmarks/RESULTS.md, 'Why CLS from scratch collapses').",
                        ("auto", "mean", "cls"))
    tokenizer: str = knob("bundled", "Tokenizer for init=scratch (HF id or folder); 'bundled' = the "
                                     "standard uncased BERT vocab of the bundled encoder.")
    query_prompt: str = knob("", "Text put before every query the student embeds, in training, mining with it and "
                                 "evaluation (e.g. 'query: '); exported as the sentence-transformers prompt named "
                                 "'query', so model.encode(texts, prompt_name='query') embeds as trained.",
                             added=True)
    passage_prompt: str = knob("", "Text put before every passage (and mined negative) the student embeds; exported "
                                   "as the prompt named 'passage'.", added=True)
    query_max_length: int = knob(32, "Token limit for queries (paper: 32).", bounds=POSITIVE)
    passage_max_length: int = knob(128, "Token limit for passages (paper: 256).", bounds=POSITIVE)
    scratch_hidden_size: int = knob(768, "Hidden size of a from-scratch BERT (BERT-base: 768).", bounds=POSITIVE)
    scratch_num_layers: int = knob(12, "Layers of a from-scratch BERT.", bounds=POSITIVE)
    scratch_num_heads: int = knob(12, "Attention heads of a from-scratch BERT.", bounds=POSITIVE)
    scratch_intermediate_size: int = knob(3072, "FFN size of a from-scratch BERT.", bounds=POSITIVE)

    def check_rules(self) -> None:
        if self.scratch_hidden_size % self.scratch_num_heads:
            raise ConfigError(f"{self.key('scratch_hidden_size')} must be divisible by "
                              f"{self.key('scratch_num_heads')}.")
