"""Adapters for the frameworks users train with: argument mapping only, no kernels."""
