"""What operators see: Prometheus metrics, the status document and table, process logs."""
