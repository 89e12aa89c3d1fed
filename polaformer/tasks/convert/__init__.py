"""Converting a trained softmax model into its Pola counterpart (:mod:`.weights`, :mod:`.build`), then attention
transfer and distillation fine-tuning on the one engine (:mod:`.transfer`, :mod:`.train`). See docs/convert.md."""
from .build import build_source, convert_model, save_converted, target_of
from .train import ConvertTask, check_convert_config, convert_config, evaluate_student, train_convert
from .transfer import AttentionTransfer, freeze_for_transfer
from .weights import FAMILIES, TARGETS, ConversionError, ConversionReport, convert_state_dict, family_of

__all__ = ["FAMILIES", "TARGETS", "AttentionTransfer", "ConversionError", "ConversionReport", "ConvertTask",
           "build_source", "check_convert_config", "convert_config", "convert_model", "convert_state_dict",
           "evaluate_student", "family_of", "freeze_for_transfer", "save_converted", "target_of", "train_convert"]
