# engine: sglang. Local servers: rule build_patched_server installs the plugin into the server's
# Python and writes patched.json; extraction jobs take it as an ancient() input (a rebuilt marker
# does not redo finished chunks) and start or reuse the server themselves (hsextract.sglang.server,
# notes/snakemake.md A6.3); onstart kills a server left by a crashed run, onsuccess/onerror stop
# ours. External servers (sglang.server_url / sglang.servers): nothing to build or start.
from hsextract.sglang import config as sglang_config

SGLANG_URLS = sglang_config.external_urls(config)
SERVER_DIR = f"results/{RUN}/server"
# the server holds the GPUs; an extraction job is a client
EXTRACT_GPUS = 0

if not SGLANG_URLS:
    ENGINE_INPUTS["patched"] = ancient(f"{SERVER_DIR}/patched.json")
    ON_START.append(lambda: sglang_config.stop_local_servers(config))
    ON_FINISH.append(lambda: sglang_config.stop_local_servers(config))

    rule build_patched_server:
        output:
            patched=f"{SERVER_DIR}/patched.json",
        log:
            f"logs/{RUN}/server/build_patched_server.log",
        conda:
            "../../envs/sglang.yaml"
        params:
            python=config["sglang"]["python"],
            repo=workflow.basedir,
        script:
            "../scripts/build_patched_server.py"
