"""Serving IHA models."""
