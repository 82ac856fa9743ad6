# hsextract: EAGLE-3 hidden-state training data (orchestration only; logic lives in src/hsextract).
import os
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

# A checkout runs without installing the package: scripts import hsextract from src/.
_SRC = Path(workflow.basedir) / "src"
if (_SRC / "hsextract").is_dir():
    sys.path.insert(0, str(_SRC))
    # jobs run scripts in new interpreters: they need the same path
    os.environ.update(
        PYTHONPATH=os.pathsep.join(
            p for p in (str(_SRC), os.environ.get("PYTHONPATH")) if p
        )
    )


configfile: "config/config.yaml"


# Snakemake skips the default config file without a word where it is missing and --configfile is given (a
# command run with -d DIR): said, with where the config's relative paths are resolved
if workflow.is_main_process and not Path("config/config.yaml").is_file():
    print(
        f"hsextract: NOTE: config/config.yaml is not in the working directory {Path.cwd()}: the embedded "
        "defaults do not apply, only the schema's and your config files' (whose relative paths are resolved "
        "against that directory)",
        file=sys.stderr,
    )


from hsextract.config.stale_lock import claim, clear_owner

# A lock left by a run killed before it could release it (kill -9, a closed terminal) is removed when its
# run is surely gone, so that the same command carries on without `snakemake --unlock`; then this run is
# recorded, before Snakemake takes the lock (the module says how it tells). Jobs Snakemake spawns parse this
# file too and leave it alone.
if workflow.is_main_process and (_unlocked := claim(Path.cwd())):
    print(_unlocked, file=sys.stderr)


from hsextract.config.guard import check_bounded
from hsextract.config.files import check_report_ready, earlier_configfiles
from hsextract.config.settings import fill_defaults

# `--configfile config/kimi.yaml --configfile my-sources.yaml`: Snakemake keeps only the last flag's files.
# Read the earlier ones too, in command-line order (Snakemake applies the kept ones after each), and pass
# them on to the jobs it spawns on clusters, so every process sees the same config.
_EARLIER = earlier_configfiles(sys.argv, workflow.overwrite_configfiles)
for _path in _EARLIER:
    workflow.configfile(_path)
if _EARLIER:
    workflow.config_settings.configfiles = [
        *_EARLIER,
        *workflow.config_settings.configfiles,
    ]

# before Snakemake's validate, which expands YAML aliases (an alias bomb would take all memory)
check_bounded(config)

from snakemake.common.configfile import load_configfile
from hsextract.capture import check_conventions_said

# an aux_layers list says its convention in its own file: inherited from another, a list written before the
# convention was recorded would be read one layer off
check_conventions_said(
    [
        *(
            (str(f), load_configfile(f))
            for f in (*_EARLIER, *workflow.overwrite_configfiles)
        ),
        ("--config", workflow.config_settings.config),
    ]
)
# the schema's first violation in one line, with the closest allowed key (Snakemake's validate prints the
# whole schema and config); validate then fills in the defaults
fill_defaults(config)
validate(config, "workflow/schemas/config.schema.yaml")

from hsextract.config.checks import check as check_config
from hsextract.report.manifest import finished_line, manifest_stamp

# Semantic checks (layer ids vs depth, model, reference sample) before any job: the settings tree
# (PLAN.settings, what workflow/rules/common.smk computes its values from) and the chunk count.
PLAN = check_config(config)
# `capture: eagle3 | dflash | mtp` presets (and lists in either convention) resolve here to hidden_states
# ids: every rule and script sees that list (hsextract.layers).
config["aux_layers"] = PLAN.aux_layers
config["aux_layers_convention"] = "hidden_states"
# `snakemake --report` of an unfinished run: said as such (Snakemake names one missing file)
check_report_ready(
    sys.argv, Path("results") / PLAN.settings.extract.run_name, PLAN.n_chunks
)
# the run's dataset.json as it is now: one this invocation writes is said at its end (onsuccess)
_MANIFEST_BEFORE = (
    manifest_stamp(Path("results") / PLAN.settings.extract.run_name)
    if workflow.is_main_process
    else None
)


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/gpu_pool.smk"
include: "workflow/rules/model.smk"


if SETTINGS.regenerate.enabled:

    include: "workflow/rules/regenerate.smk"


if SETTINGS.extract.engine == "sglang":

    include: "workflow/rules/server.smk"


include: "workflow/rules/prepare.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/stats.smk"
include: "workflow/rules/export.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),


onstart:
    run_hooks(ON_START)


onsuccess:
    clear_owner(Path.cwd())
    run_hooks(ON_FINISH)
    if _finished := finished_line(
        Path("results") / PLAN.settings.extract.run_name, _MANIFEST_BEFORE
    ):
        print(_finished, file=sys.stderr)


onerror:
    clear_owner(Path.cwd())
    run_hooks(ON_FINISH)
