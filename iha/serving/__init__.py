"""Serving IHA models: `iha serve` (an OpenAI-compatible server for local and small-scale use)."""
