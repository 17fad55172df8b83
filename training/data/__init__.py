"""Training data: sources, tokenization, chat rendering, packing, and the `prepare` command."""
