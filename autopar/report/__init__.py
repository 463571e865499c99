"""Report stage: what was chosen, why, and what it costs, for terminals, files and browsers."""
