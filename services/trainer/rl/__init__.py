"""Reinforcement fine-tuning: the RL loop of managed RFT jobs (loop.py), its rollout process (rollout.py), the
advantage / staleness / importance-weight arithmetic (algo.py) and the rewards (rewards.py). See docs/rft.md."""
