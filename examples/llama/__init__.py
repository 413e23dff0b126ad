"""The pieces of `examples/train_llama.py`: the model, the corpus, the training loop and the report."""
