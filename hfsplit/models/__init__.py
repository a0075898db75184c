"""What a model family is: which families split (`families`), how a causal LM is laid out (`layout`), its layer
kinds, MoE expert naming, the attention masks a block gets and the causal-LM loss."""
