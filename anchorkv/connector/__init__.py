"""The vLLM connector (`AnchorKVConnector`); importing it needs vLLM installed."""
