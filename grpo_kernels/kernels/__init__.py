"""The vocabulary pass, once per backend: the kernels and their autograd Functions (`README.md`: adding a backend)."""
