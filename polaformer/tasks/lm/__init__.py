"""Byte-level language modelling on the Python standard library's own files, trained through the one engine:
the data (:mod:`polaformer.data.text`) and the task, evaluation in bits per byte and sampling (:mod:`.train`)."""
from ...data.text import ByteWindows, stdlib_corpus
from .train import (
    RULES,
    SAMPLING,
    LMTask,
    evaluate_bits_per_byte,
    lm_config,
    load_lm_model,
    train_lm,
    unigram_bits_per_byte,
)

__all__ = ["RULES", "SAMPLING", "ByteWindows", "LMTask", "evaluate_bits_per_byte", "lm_config", "load_lm_model",
           "stdlib_corpus", "train_lm", "unigram_bits_per_byte"]
