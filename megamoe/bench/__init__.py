"""Layer benchmark: ``python -m megamoe.bench --help``."""
