"""The SGLang side of the sglang engine: a plugin that dumps per-request hidden states to files.

This package is what the SGLang server process imports (through the `sglang.srt.plugins` entry point
`hsextract`, installed by rule build_patched_server); outside it, only hsextract's standard-library-only
leaves `errors`, `layers`, `capture` and `atomic` (`hsextract.sglang.config.SERVER_MODULES`, checked
against a fresh interpreter's imports by tests/test_sglang_api.py and covered by the install check's hash).
`plugin.register` is the entry point and the only module that imports SGLang. `settings` (the HSEXTRACT_*
environment), `dumpfiles` (the file format shared with the client), slicing, staging and writing are plain
Python/torch and run (and are tested) without SGLang.
"""
