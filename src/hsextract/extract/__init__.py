"""Extract: one chunk of prompts through an engine (hsextract.engines, hsextract.sglang) into one shard."""
