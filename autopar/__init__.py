"""autopar: trace a PyTorch model, price every way of splitting it, and emit the fastest plan."""

__version__ = "0.1.0"
