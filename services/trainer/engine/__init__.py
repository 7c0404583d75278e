"""The training engine (engine.py): every trainer path builds, steps and saves a model through it."""
from services.trainer.engine.engine import TrainingEngine, training_device, training_dtype
from services.trainer.engine.optim import AdamW

__all__ = ["AdamW", "TrainingEngine", "training_device", "training_dtype"]
