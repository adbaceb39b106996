"""An upload over 2 GB across a TLS + authenticated loopback Flower deployment: does it arrive bit
for bit, and what memory does it take on each side?

    python bench/large_upload.py               # one fp32 tensor of 2.2 GB (protobuf's limit is 2 GiB - 1)
    python bench/large_upload.py --gb 0.5      # a smaller one, for the memory it costs per byte

DeepFusion's devices upload their whole model once: at the paper's 0.5-1B devices that is 2-4 GB
in fp32, past the 2 GB limit of a single protobuf message. Flower (since 1.20) cuts each array
into 5 MB chunks that travel as objects of their own; this bench sends one synthetic device
upload through comix's own path (bench/large_upload_app/: ``wire.to_arrays`` on the device,
``FlowerTransport.train`` in the ServerApp) and checks the SHA-256 of what arrived against the
device's. Peak memory: the ServerApp's own getrusage peak; the device process (flwr-clientapp),
the SuperNode and the SuperLink sampled from /proc (their VmHWM, every 0.2 s).
Writes ``bench/results/large-upload.json``; docs/flower.md quotes it (bench/tables.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit

ROOT = Path(__file__).resolve().parents[1]
APP = Path(__file__).parent / "large_upload_app"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.2, help="the upload's size in GB (10^9 bytes), fp32")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "large-upload")
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "large-upload.json")
    args = ap.parse_args()
    import flwr
    import torch

    from comix.engines.flower.deploy import Federation, _descendants, memory_mb, named

    floats = int(args.gb * 1e9 / 4)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    answer = args.workdir / "server-side.json"
    peaks = {"device_clientapp": 0.0, "supernode": 0.0, "superlink": 0.0}
    done = threading.Event()
    t0 = time.time()
    with Federation(args.workdir / "fed") as fed:
        fed.start_superlink()
        fed.start_supernode(0, {"floats": floats})

        def sample():
            while not done.is_set():
                link, node = fed.procs["superlink"].pid, fed.procs["supernode0"].pid
                peaks["superlink"] = max(peaks["superlink"], memory_mb(link, "VmHWM"))
                peaks["supernode"] = max(peaks["supernode"], memory_mb(node, "VmHWM"))
                for pid in named(_descendants(node), "flwr-clientapp"):
                    peaks["device_clientapp"] = max(peaks["device_clientapp"], memory_mb(pid, "VmHWM"))
                time.sleep(0.2)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        res = fed.run({"result": str(answer), "timeout": 1800.0}, app=APP, timeout=3600)
        done.set()
        sampler.join()
    if not answer.exists():
        sys.exit(f"the ServerApp wrote no result:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}\n"
                 f"logs: {args.workdir / 'fed'}")
    out = json.loads(answer.read_text())
    gb = out.get("bytes", floats * 4) / 1e9
    out.update({f"{k}_peak_rss_mb": round(v, 1) for k, v in peaks.items()},
               upload_gb=round(gb, 3), wall_s=round(time.time() - t0, 1),
               command="python bench/large_upload.py " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d"),
               machine=f"{os.cpu_count()} cores of an {footprint.cpu_name()}, alone", torch=torch.__version__,
               flwr=flwr.__version__, chunk_mb=int(os.environ.get("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 5242880)) / 2**20)
    print(json.dumps(out, indent=1))
    footprint.write_result(args.result, out)
    if not out.get("bit_exact"):
        sys.exit(f"the upload did not arrive bit for bit: {out}")


if __name__ == "__main__":
    main()
