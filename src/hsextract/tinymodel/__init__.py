"""The embedded tiny model: a miniature Kimi-K2.5, its tokenizers, chat template and packaging.

`python -m hsextract.tinymodel` builds one (hsextract.tinymodel.build)."""
