import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def listen_port(block: int) -> int:
    """A port (and the next) for a test's own servers: below the kernel's ephemeral range, so that no client
    socket's local port can hold it (a bench opens many connections; a fake server once failed to bind a port
    in that range), and per process, so that two runs of the suite on one machine differ. Blocks of 1000:
    0 and 1 the benches' dry runs, 2 the fake SGLang servers of test_sglang_client (the servers set
    SO_REUSEADDR, so one test's port is free again for the next), 3 those of test_server_door, 4 the server
    a workflow of test_workflow_sglang starts, 5 the two replicas another one starts. Under pytest-xdist each
    worker takes its own residue of the block's 500 slots, so that two workers of one run never share a port."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    port = 20000 + 1000 * block + 2 * (os.getpid() % (500 // workers) * workers + worker)
    assert port + 1 < low, f"port {port} is inside the ephemeral range from {low}"
    return port


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a slow test first (a stable sort: each module's tests stay together and in order), so that
    `make test`'s workers (one module each, --dist loadfile) start the long ones early and finish together."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)


def shard_metadata(**over):
    meta = dict(
        model="test-model", engine="transformers", engine_version="test", aux_layers=[1, 2, 3],
        final_state="post_norm", hidden_size=16, dtype="bfloat16", config_hash="c0", tokenizer_hash="t0",
        chat_template_hash="h0",
    )
    meta.update(over)
    return meta


# Small shapes for a random-weight model of any family (each config takes the keys it has).
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=300, moe_intermediate_size=32, n_routed_experts=4, num_experts=4, num_local_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128)


def finish_run(run: Path) -> Path:
    """`run` made a finished run folder: its dataset.json lists every shard of run/shards (path, size, sha256),
    what the reader needs of the manifest job's file (a run folder without one is refused as unfinished)."""
    import json

    from hsextract.provenance import sha256_file

    shards = sorted((run / "shards").glob("*.hss"))
    entries = [{"path": f"shards/{s.name}", "bytes": s.stat().st_size, "sha256": sha256_file(s)} for s in shards]
    (run / "dataset.json").write_text(json.dumps({"shards": entries}))
    return run


def tiny_checkpoint(model_type: str, path: Path, num_hidden_layers: int = 2, **config: Any):
    """A random-weight bf16 checkpoint of `model_type` (transformers' own modeling code) saved at `path`, hidden 64,
    its final norm's weight drawn away from ones and zeros (so that the norm formulas differ); returns the model.
    `config`: further config keys (a sliding window, say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(model_type)
    kw = {k: v for k, v in SMALL.items() if hasattr(base, k)}
    if hasattr(base, "layer_types"):
        kw["layer_types"] = None  # recomputed for the small layer count
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, pad_token_id=0, num_hidden_layers=num_hidden_layers, **kw | config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(SMALL["hidden_size"]) * 0.3 + 1)
    model.save_pretrained(path)
    return model


def make_sample(seq, hidden=16, n=4, dtype=torch.bfloat16, seed=0, trained=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (seq,), generator=g)
    mask = (torch.rand(seq, generator=g) > 0.5).long()
    if trained:
        mask[-1] = 1
    else:
        mask.zero_()
    hs = [(torch.randn(seq, hidden, generator=g) * (k + 1)).to(dtype) for k in range(n)]
    return ids, hs, mask


@pytest.fixture
def meta():
    return shard_metadata()


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    """Threads for set-up a module's later tests need (Snakemake runs in project copies): started early, it
    runs in subprocesses on the core the tests in front leave idle; a test waits on its future (an event,
    never a sleep). Joined when the module ends."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hsx-background")
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


def selected_names(request: pytest.FixtureRequest) -> set[str]:
    """The names of the requesting module's selected tests and of every fixture they use."""
    names: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            names |= {item.originalname, *getattr(item, "fixturenames", ())}
    return names


def selected_tests_use(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a selected test of the requesting module uses `fixture`: background set-up starts only then."""
    return fixture in selected_names(request)


@pytest.fixture(scope="module")
def scenarios_started(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Any]]:
    """The module's SCENARIOS (a test's or fixture's name -> function of a fresh folder: the run a test
    asserts on), those a selected test is or uses (as `name` or `name_started`), all started in the
    background with the module's first test. Runs that need another fixture's result are set up by hand
    (test_faults)."""
    wanted = selected_names(request)
    return {name: background.submit(run, tmp_path_factory.mktemp(name.removeprefix("test_")[:30]))
            for name, run in request.module.SCENARIOS.items() if name in wanted or f"{name}_started" in wanted}


@pytest.fixture(scope="module", autouse=True)
def _scenarios_start_early(request: pytest.FixtureRequest) -> None:
    # with the module's first test, so that the tests in front of those that wait on a run overlap it
    if getattr(request.module, "SCENARIOS", None):
        request.getfixturevalue("scenarios_started")


@pytest.fixture
def scenario(request: pytest.FixtureRequest, scenarios_started: dict[str, Future[Any]]) -> Any:
    """What this test's SCENARIOS entry returned (it ran in the background; this waits on it)."""
    return scenarios_started[request.node.originalname].result()
