"""CPU replay (no GPU) of the failed H200 throughput run (b), through tests/fake_sglang.py and the real
plugin code: hidden 4096, aux [1,15,28] (4 tensors), 512-token prompts, 32 in flight, chunked prefill 8192
(16 requests per pass), staging 8192 MiB; a warm-up extract, then the measured extract on the SAME engine
instance, as bench/sglang_throughput.py did. SAME_RIDS=1 replays the old client (rids repeat per call).

    PYTHONPATH=src python bench/gpu/cpu_replay_run_b.py [N_PROMPTS]      # ~20 s, ~2 GB of /dev/shm traffic
"""
import sys, time, tempfile, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import torch
from fake_sglang import FakeServer
from hsextract.engines.base import CaptureSpec, Prompt
from hsextract.sglang.client import SGLangEngine
from hsextract.errors import EngineError

H, AUX, L, N = 4096, (1, 15, 28), 512, int(sys.argv[1]) if len(sys.argv) > 1 else 64
d = Path(tempfile.mkdtemp(dir="/dev/shm"))
srv = FakeServer(d, AUX, chunk=8192, hidden=H, staging_bytes=8192 << 20, pass_delay_s=0.05).start()
g = torch.Generator().manual_seed(512)
ps = [Prompt(i, f"{L}-{i}", torch.randint(0, 128256, (L,), generator=g).tolist()) for i in range(N)]
eng = SGLangEngine(srv.url, CaptureSpec(aux_layers=AUX), d, concurrency=32, timeout_s=20, retries=0)
import itertools, os
if os.environ.get("SAME_RIDS"): eng._calls = itertools.repeat(0)  # the old client: rids repeat across calls
t = time.monotonic()
w = list(eng.extract(ps[:32]))
print(f"warm-up: {len(w)} samples in {time.monotonic()-t:.1f} s, passes {srv.passes}, max batch {srv.max_batch}", flush=True)
t = time.monotonic()
try:
    got = list(eng.extract(ps))
    print(f"measured: {len(got)} samples in {time.monotonic()-t:.1f} s")
except EngineError as e:
    print(f"measured run FAILED after {time.monotonic()-t:.1f} s: {e}")
srv.dumper.writer.flush()
print("writer stats:", json.loads(next(d.glob("stats-*.json")).read_text()))
print("files left:", sorted(p.name for p in d.iterdir())[:5])
srv.stop()
import shutil
shutil.rmtree(d)
