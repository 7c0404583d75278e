"""Job methods' settings, declared once and torch-free: what the scheduler checks at CreateJob, the worker's recipe
runs and the trainer trains with (sft.py; DPO and RL join here)."""
