"""Hand-off to deployment stacks (DeepStream)."""
