"""Inference: one stage serving generation sessions, local generation, generation through a swarm."""
