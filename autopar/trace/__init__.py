"""Trace stage: capture a training step as an ATen fx graph and group its nodes into layers."""
from autopar.trace.capture import BACKWARD, FORWARD, CapturedStep, capture_training_step
from autopar.trace.layers import LayerGrouping, find_block_containers, group_layers

__all__ = ["BACKWARD", "FORWARD", "CapturedStep", "LayerGrouping", "capture_training_step",
           "find_block_containers", "group_layers"]
