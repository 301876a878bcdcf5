"""The character-level GPT example that examples/train_lm.py runs: loop, model, data, report."""
