"""The vocabulary pass: log-softmax gather and entropy over V, and their gradient, once per backend."""
