"""The client side of the sglang engine: server settings (`config`), server lifecycle (`server`), the engine
that talks to a server (`client`) and the SGLang compatibility check (`compat`).

The server process itself imports only `hsextract.sglang_plugin`.
"""
