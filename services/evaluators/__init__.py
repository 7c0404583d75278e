"""Uploaded evaluators (reward functions and multi-turn environments): the sandbox that runs them, and their store."""
