"""Prepare: sources, the weighted mixture, tokenizers, loss masks (hsextract.masks) and filters, to prompt chunks."""
