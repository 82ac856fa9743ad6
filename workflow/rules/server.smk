# engine: sglang. Local servers: rule build_patched_server installs the plugin into the server's
# Python and writes patched.json; extraction jobs take it as an ancient() input (a rebuilt marker
# does not redo finished chunks) and start or reuse the server themselves (hsextract.sglang.server,
# notes/snakemake.md A6.3); onstart kills a server left by a crashed run, onsuccess/onerror stop
# ours. External servers (sglang.server_url / sglang.servers): nothing to build or start.
from snakemake_interface_executor_plugins.settings import DeploymentMethod

from hsextract.sglang import config as sglang_config

SGLANG_URLS = sglang_config.external_urls(config)
SERVER_DIR = f"results/{RUN}/server"
# An extraction job starts (or reuses) its own local servers: it needs their tp x replicas GPUs on its
# node. With external servers it is a client and needs none.
_SGLANG = sglang_config.settings(config)
EXTRACT_GPUS = 0 if SGLANG_URLS else _SGLANG["tp"] * _SGLANG["replicas"]

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
            # null python: the job's interpreter, only if it is envs/sglang.yaml's (--sdm conda)
            conda_env=DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method,
            repo=workflow.basedir,
        script:
            "../scripts/build_patched_server.py"
