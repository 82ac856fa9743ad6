# engine: sglang. Local servers: rule build_patched_server installs the plugin into the server's
# Python and writes patched.json; extraction jobs take it as an ancient() input (a rebuilt marker
# does not redo finished chunks) and start or reuse the server themselves (hsextract.sglang.server: no
# Snakemake service job and no server-ready file in the DAG, so a rerun reuses a live server and a
# finished chunk never waits for one). External servers (sglang.server_url / sglang.servers): nothing
# to build or start. The values read here (SGLANG_LOCAL, SERVER_DIR) and the hooks that stop servers
# are computed in common.smk.
from snakemake_interface_executor_plugins.settings import DeploymentMethod

from hsextract.extract.gpu_pool import plans_jobs

CONDA_ENV = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
# no server Python to build into: said by the dry run already, not by the build job (on a cluster, after its queue)
if (
    SGLANG_LOCAL
    and workflow.is_main_process
    and plans_jobs(sys.argv)
    and not Path(f"{SERVER_DIR}/patched.json").exists()
    and (
        _why := sglang_config.no_build_python(SETTINGS.extract.sglang.python, CONDA_ENV)
    )
):
    print(
        f"hsextract: WARNING: rule build_patched_server will stop: {_why}",
        file=sys.stderr,
    )

if SGLANG_LOCAL:

    rule build_patched_server:
        output:
            patched=f"{SERVER_DIR}/patched.json",
        log:
            f"logs/{RUN}/server/build_patched_server.log",
        conda:
            "../../envs/sglang.yaml"
        params:
            settings=RERUN["build_patched_server"],
            # null python: the job's interpreter, only if it is envs/sglang.yaml's (--sdm conda)
            conda_env=CONDA_ENV,
            repo=workflow.basedir,
        script:
            "../scripts/build_patched_server.py"
