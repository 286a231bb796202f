"""Training at work: the stage worker, the step engine, boundary frames, replicas and their averaging."""
