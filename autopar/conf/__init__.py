"""Hydra configuration shipped with autopar (installed as the package `autopar.conf`)."""
