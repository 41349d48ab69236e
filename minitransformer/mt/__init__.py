"""Translation tooling: synthetic corpus, tokenizer, data and batching, search, checkpoints, CLIs."""
