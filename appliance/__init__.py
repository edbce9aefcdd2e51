"""appliance: a self-hosted, single-box LLM server with an OpenAI-compatible API."""

__version__ = "0.1.0"
