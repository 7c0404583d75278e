"""The no-code tier's Training Agent (agent.py), its rules (rules.py) and run diagnosis (diagnose.py): a client of
the scheduler's APIs, torch-free."""
