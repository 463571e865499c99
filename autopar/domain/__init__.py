"""The plan's domain: the words every stage speaks, the layout, the mesh, the technique registry
and the rules a plan obeys. It imports nothing of autopar above it (tests/unit/test_layers.py)."""
