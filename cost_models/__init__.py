"""Cost models: price any parallel plan on any GPU cluster (compute, collectives, memory, pipeline)."""
