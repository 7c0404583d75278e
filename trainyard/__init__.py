"""Trainyard: fine-tune and reinforce open LLMs on your own hardware."""
from trainyard.client import Client
from trainyard.errors import FieldError, TrainyardError

__all__ = ["Client", "TrainyardError", "FieldError"]
__version__ = "0.1.0"
