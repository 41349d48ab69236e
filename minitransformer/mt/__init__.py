"""Translation tooling: synthetic corpus, tokenizer, data and batching, search, checkpoints,
the run directory, the training loop and the command lines."""
