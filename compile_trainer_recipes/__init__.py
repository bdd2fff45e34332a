"""Bundled training recipes: small, real models trained on text that ships with Python."""
