"""The workers and devices of the train section (config only, torch-free; the trainer is train/trainer.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import NON_NEGATIVE, POSITIVE, Section, knob


@dataclass
class ComputeConfig(Section):
    """Workers, devices and memory."""
    section: ClassVar[str] = "train"

    num_workers: int = knob(2, "Ray Train workers (DDP ranks).", affects_output=False, bounds=POSITIVE)
    use_gpu: bool = knob(False, "One GPU per worker, nccl and bf16 autocast.", affects_output=False)
    grad_cache_chunk: int = knob(0, "GradCache: embed each rank's rows in chunks of this many pairs, so "
                                    "activation memory no longer grows with the batch; 0 = off. Same "
                                    "gradients, ~1/3 more compute.", affects_output=False, bounds=NON_NEGATIVE)
    packing: str = knob("auto", "How the student's forward holds a batch's texts: 'packed' end to end (no "
                                "padding; attention within each text by a variable-length kernel: flash-attn, "
                                "else torch's varlen_attn; on a CPU one attention call per text), 'padded' to the "
                                "longest. 'auto' packs on CPUs (1.7x faster steps than padding on the bundled data) "
                                "and on a GPU that has such a kernel, pads on one that has none; packing is first "
                                "checked against padding on the student's own weights (a model that differs is "
                                "padded). The same gradients to rounding; MFU then counts real tokens, not padding.",
                        ("auto", "packed", "padded"), affects_output=False, added=True)
    prefetch_steps: int = knob(8, "Read this rank's rows this many global steps ahead, with up to 4 reads in "
                                  "flight at once (an object store answers each request in tens of ms; the "
                                  "progress line says when steps waited for data). Memory: this many batches "
                                  "of rows per rank.", affects_output=False, bounds=POSITIVE, added=True)
    peak_tflops: float = knob(0.0, "Peak TFLOP/s of one worker's device for the MFU estimate; 0 = look up the "
                                   "GPU, or measure an fp32 matmul on CPU.", affects_output=False,
                              bounds=NON_NEGATIVE)
