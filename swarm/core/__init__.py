"""The model and its mathematics: run configuration (torch-free), the decoder, the shared subspace,
MAPL, optimizers."""
