"""Published training runs as data (runs.yaml) and their comparison with the cost model."""
