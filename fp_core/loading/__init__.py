"""Loads and checks: a file read whole or mapped, load_into existing (and DTensor) tensors, verify."""
