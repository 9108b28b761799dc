"""OpenRLHF 0.11.2's modules as the adapter, its critic and its step import them: module-level imports that do not
import here (transformers, peft, deepspeed, flash-attn's CUDA package) stubbed strictly
(:func:`~spec.engines.kit.stub_imports`), flash-attn's pure-torch ``bert_padding`` the real file from the
flash-attn 2.8.3 sdist (installed as ``flash_attn_bert_padding`` by the `openrlhf` CI step, ``ci.sh``)."""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from ..kit import require, stub_imports
from ..kit.stubs import strict_module

__all__ = ["EAGER", "PACKAGES", "openrlhf_modules"]

PACKAGES = ("peft", "transformers", "deepspeed", "flash_attn")
#: compute_entropy is @torch.compile'd: every new (n, V) shape would compile it (seconds each on CPU); its code
#: runs eagerly instead (the same torch calls; a compiled kernel may round differently)
EAGER = torch._dynamo.config.patch(disable=True)


@lru_cache(maxsize=1)
def openrlhf_modules():
    """``(Actor, openrlhf.utils.utils, merge_mm_train_inputs)``, imported once."""
    strict_module("flash_attn")
    sys.modules["flash_attn.bert_padding"] = require(
        "flash_attn_bert_padding", "flash-attn 2.8.3's bert_padding.py as this module (.ci/steps/bert_padding.py)")
    strict_module("pylatexenc.latex2text")  # openrlhf.utils' math grader, never run here
    return (stub_imports("openrlhf.models.actor", PACKAGES).Actor, stub_imports("openrlhf.utils.utils", PACKAGES),
            stub_imports("openrlhf.utils.vlm_utils", (*PACKAGES, "PIL")).merge_mm_train_inputs)
