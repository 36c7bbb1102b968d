"""Building blocks of the model forward: norms, rotary embeddings, linear maps, attention."""
