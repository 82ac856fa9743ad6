"""Loss masks from the chat template (placeholder docstring, replaced below)."""
