"""Small examples to use from a service config (e.g. ``preprocess`` functions)."""
