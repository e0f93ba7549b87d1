"""The GEM model in plain PyTorch (no process groups, no device choices). See docs/contracts.md."""

from gemrec.model.config import FeatureSchema, ModelConfig, SparseFeature
from gemrec.model.ensemble import Ensemble
from gemrec.model.gem import DLRMModel, GEMModel, build_model, loss, model_flops
from gemrec.model.inputs import JaggedFeatures, ModelInput, ModelOutput
from gemrec.model.moe import GroupedExperts, MoEFeedForward
from gemrec.model.step import StepResult, train_step

__all__ = [
    "DLRMModel",
    "Ensemble",
    "FeatureSchema",
    "GEMModel",
    "GroupedExperts",
    "JaggedFeatures",
    "ModelConfig",
    "ModelInput",
    "ModelOutput",
    "MoEFeedForward",
    "SparseFeature",
    "StepResult",
    "build_model",
    "loss",
    "model_flops",
    "train_step",
]
