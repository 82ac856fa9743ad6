"""The SGLang side of the sglang engine: a plugin that dumps per-request hidden states to files.

`plugin.register` is the entry point (group `sglang.srt.plugins`); it is the only module that imports
SGLang. Slicing, staging and writing are plain torch and run (and are tested) without SGLang.
"""
