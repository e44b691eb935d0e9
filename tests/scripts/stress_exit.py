"""Stress check: do finished runs always exit? Many torchrun runs, beside a CPU-heavy process.

    python tests/scripts/stress_exit.py                  # 100 runs of each variant (about 40 min)
    python tests/scripts/stress_exit.py --runs 5 --variants stock-table
    python tests/scripts/stress_exit.py --runs 40 --variants client-stock client-manual \
        client-bucketed client-naive                     # a client's own setup and teardown

Not part of the test suite (it takes long); run it after touching setup or teardown.
Each variant is one example with or without --grad-table, or the nanoGPT-shaped client
with one wrapper, 2 processes under torchrun; the variants take turns. Each run is classified:

    clean           exit 0, accuracy printed
    hang-finished   still running at --limit after printing its accuracy (a teardown hang)
    hang            still running at --limit, before finishing
    abort           "terminate called" or SIGABRT in the output (an abort at exit)
    failed          any other non-zero exit

Exit status 0 when every run is clean.
"""

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import REPO, Hang, torchrun  # noqa: E402

VARIANTS = {
    "stock": ("stock_ddp.py", False), "stock-table": ("stock_ddp.py", True),
    "manual": ("manual_ddp.py", False), "manual-table": ("manual_ddp.py", True),
}
# A client's order: tests/clients/nanogpt_train.py sets up its own group and destroys it
# with the model alive; its DDP import swapped for each wrapper.
CLIENT = REPO / "tests" / "clients" / "nanogpt_train.py"
STOCK_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP"
CLIENT_IMPORTS = {"client-stock": STOCK_IMPORT,
                  "client-manual": "from minddp import ManualDDP as DDP",
                  "client-bucketed": "from minddp import BucketedDDP as DDP",
                  "client-naive": "from minddp import NaiveDDP as DDP"}
KINDS = ["clean", "hang-finished", "hang", "abort", "failed"]


def burn():
    """The load: one process spinning on arithmetic, as another job on the machine would."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


def classify(result_or_hang):
    out, err = result_or_hang.stdout, result_or_hang.stderr
    if "terminate called" in err or "SIGABRT" in err or "Signal 6" in err:
        return "abort"
    finished = "Test accuracy" in out or out.count("val loss") == 2
    if isinstance(result_or_hang, Hang):
        return "hang-finished" if finished else "hang"
    return "clean" if result_or_hang.returncode == 0 and finished else "failed"


def launch(variant, tmp, limit):
    if variant in CLIENT_IMPORTS:
        script = Path(tmp, f"{variant}.py")
        if not script.exists():
            script.write_text(CLIENT.read_text().replace(STOCK_IMPORT, CLIENT_IMPORTS[variant]))
        return torchrun(2, script, tmp, timeout=limit)
    script, table = VARIANTS[variant]
    extra = ["--grad-table", os.path.join(tmp, f"{variant}.txt")] if table else []
    return torchrun(2, REPO / "examples" / script, *extra, timeout=limit)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        choices=list(VARIANTS) + list(CLIENT_IMPORTS))
    parser.add_argument("--load", type=int, default=1, help="CPU-heavy processes beside the runs")
    parser.add_argument("--limit", type=float, default=60, help="seconds before a run counts as hung")
    args = parser.parse_args()

    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    counts = {v: dict.fromkeys(KINDS, 0) for v in args.variants}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                for variant in args.variants:
                    try:
                        result = launch(variant, tmp, args.limit)
                    except Hang as hang:
                        result = hang
                    kind = classify(result)
                    counts[variant][kind] += 1
                    if kind != "clean":
                        print(f"run {i} {variant}: {kind}\n{result.stderr[-1500:]}", flush=True)
                print(f"{i + 1}/{args.runs} rounds, {time.monotonic() - t0:.0f} s: "
                      + "; ".join(f"{v} {c['clean']} clean" for v, c in counts.items()), flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(f"\n{os.cpu_count()} CPUs, load: {args.load} busy process(es), limit {args.limit:.0f} s")
    print(f"{'variant':14}" + "".join(f"{k:>15}" for k in KINDS))
    for v, c in counts.items():
        print(f"{v:14}" + "".join(f"{c[k]:>15}" for k in KINDS))
    return 0 if all(c["clean"] == args.runs for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
