# The GPU pool against one extract job's GPUs (EXTRACT_GPUS, common.smk), before any job and in dry runs:
# Snakemake would cut a job larger than the pool to the pool without a word. A local run refuses and names
# --resources gpu=N; profiles/default's local pool under a cluster executor (a cluster profile given with
# --profile, beside the default workflow profile) is lifted. hsextract.extract.gpu_pool says why.
from hsextract.extract import gpu_pool

if workflow.is_main_process and gpu_pool.plans_jobs(sys.argv):
    _GPU_POOL = gpu_pool.settle(
        need=EXTRACT_GPUS,
        pool=workflow.global_resources.get("gpu").value,
        executor=gpu_pool.executor_of(sys.argv, (os.getcwd(), workflow.basedir)),
        pool_from_command_line=gpu_pool.pool_on_command_line(sys.argv),
        why=(
            f"engine sglang: a local server of sglang.tp {SETTINGS.extract.sglang.tp}"
            if SGLANG_LOCAL
            else f"engine {SETTINGS.extract.engine}"
        ),
        replicas=SETTINGS.extract.sglang.replicas if SGLANG_LOCAL else 1,
    )
    if _GPU_POOL.lifted:
        workflow.global_resources["gpu"] = None
    if _GPU_POOL.note:
        print(_GPU_POOL.note, file=sys.stderr)
