#!/usr/bin/env python3
"""PyTorch's LayerNorm (eager and under torch.compile), timed as ln-bench times ours, and a
merged table per (mode, dtype) with ours / theirs.

    python3 benches/peers.py --ours ours.json [--json peers.json]
    python3 benches/peers.py --ours ours.json --theirs peers.json   # merge saved results only

Timing as ln-bench and triton.testing.do_bench: CUDA events around the call, warm-up first,
a 256 MiB buffer written between repetitions (outside the timed region) to flush L2, median
and 20%/80% quantiles. GB/s: forward 2*M*N*bytes, backward 3*M*N*bytes; the backward is
y.backward(dy, retain_graph=True) with dgamma and dbeta computed, gradients reset to None
between repetitions (outside the timed region) so that none is accumulated. Each
configuration is checked against float64 first; a wrong one is reported FAILED, not timed.
Needs PyTorch with CUDA, except with --theirs.
"""

import argparse
import json
import sys
from datetime import datetime, timezone

GPU_NS = [512 * i for i in range(2, 32)] + [32768, 65536]
QUICK_NS = [1024, 4096, 8192, 32768]
DTYPES = ["f16", "bf16", "f32"]
MODES = ["fwd", "bwd"]
PEERS = ["torch", "torch-compile"]
EPS = 1e-5
FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30
BYTES = {"f16": 2, "bf16": 2, "f32": 4}
UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24}


def tolerance(dtype):
    """As ln-bench: four unit roundoffs of the storage type, at least 1e-4."""
    return max(4 * UNIT_ROUNDOFF[dtype], 1e-4)


def moved_bytes(mode, dtype, m, n):
    return (2 if mode == "fwd" else 3) * m * n * BYTES[dtype]


def quantiles(ms):
    """Median, 20% and 80%, interpolated linearly between order statistics (as torch.quantile)."""
    ms = sorted(ms)

    def at(q):
        pos = q * (len(ms) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

    return {"median_ms": at(0.5), "p20_ms": at(0.2), "p80_ms": at(0.8)}


# --- measuring (needs torch) ---------------------------------------------------------------


def time_cuda(torch, op, warmup, reps, before=None):
    """Quantiles of `op`'s time in ms; `before` runs ahead of each repetition, untimed."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        op()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if before:
            before()
        flush.zero_()
        start.record()
        op()
        end.record()
    torch.cuda.synchronize()
    return quantiles([s.elapsed_time(e) for s, e in events])


def rel_err(out, ref):
    """||out - ref|| / ||ref||; infinite where out holds NaN or infinity."""
    out, ref = out.double(), ref.double()
    if not out.isfinite().all():
        return float("inf")
    norm, diff = ref.norm().item(), (out - ref).norm().item()
    return diff / norm if norm > 0 else diff


def measure(torch, F, mode, dtype, m, n, peer, warmup, reps, seed):
    """One configuration: check against float64, then time. Returns a result record."""
    tdtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spread = 10 ** (torch.rand(m, 1, device="cuda", generator=gen) * 2 - 1)
    offset = spread * (torch.rand(m, 1, device="cuda", generator=gen) * 4 - 2)
    x = (offset + spread * (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1)).to(tdtype)
    dy = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(tdtype)
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(tdtype)
    b = (torch.rand(n, device="cuda", generator=gen) - 0.5).to(tdtype)
    record = {"mode": mode, "dtype": dtype, "provider": peer, "m": m, "n": n, "tolerance": tolerance(dtype)}

    def layer_norm(x, w, b):
        return F.layer_norm(x, (n,), w, b, EPS)

    try:
        if peer == "torch-compile":
            torch._dynamo.reset()  # a fresh static compile per size, no recompile limit
            layer_norm = torch.compile(layer_norm, dynamic=False)
        leaves = [t.detach().requires_grad_(mode == "bwd") for t in (x, w, b)]
        y = layer_norm(*leaves)
        ref_leaves = [t.detach().double().requires_grad_(mode == "bwd") for t in (x, w, b)]
        y_ref = F.layer_norm(ref_leaves[0], (n,), ref_leaves[1], ref_leaves[2], EPS)
        if mode == "fwd":
            err = rel_err(y, y_ref)
            op = lambda: layer_norm(*leaves)  # noqa: E731
            before = None
        else:
            y.backward(dy, retain_graph=True)
            y_ref.backward(dy.double())
            err = max(rel_err(t.grad, r.grad) for t, r in zip(leaves, ref_leaves))
            op = lambda: y.backward(dy, retain_graph=True)  # noqa: E731

            def before():
                for t in leaves:
                    t.grad = None

        del y_ref, ref_leaves  # float64 copies: free them before timing
        record["check_error"] = err if err != float("inf") else None
        if not err <= tolerance(dtype):
            record.update(status="failed", failure=f"relative error {err:.2e} > tolerance {tolerance(dtype):.1e}")
            return record
        time = time_cuda(torch, op, warmup, reps, before)
    except Exception as e:  # torch.compile can fail on a given setup: report, do not stop
        record.update(status="n/a", failure=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return record
    gbps = moved_bytes(mode, dtype, m, n) / (time["median_ms"] * 1e-3) / 1e9
    record.update(status="ok", gbps=gbps, **time)
    return record


def measure_all(args, sizes):
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("peers.py: PyTorch sees no CUDA device")
    src = torch.full((COPY_BYTES,), 7, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = time_cuda(torch, lambda: dst.copy_(src), args.warmup, args.reps)
    copy["gbps"] = 2 * COPY_BYTES / (copy["median_ms"] * 1e-3) / 1e9
    del src, dst
    run = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "copy": copy,
        "reps": args.reps,
        "warmup": args.warmup,
        "results": [],
    }
    print(f"peers: {run['device']}, torch {run['torch']}, copy {copy['gbps']:.1f} GB/s", file=sys.stderr)
    for i, (mode, dtype, m, n) in enumerate(sizes):
        for peer in PEERS:
            r = measure(torch, F, mode, dtype, m, n, peer, args.warmup, args.reps, args.seed)
            run["results"].append(r)
            shown = f"{r['gbps']:.1f} GB/s" if r["status"] == "ok" else r["status"] + " " + r.get("failure", "")
            print(f"[{i + 1}/{len(sizes)}] {mode} {dtype} N={n} {peer}: {shown}", file=sys.stderr)
        torch.cuda.empty_cache()
    return run


# --- merging and printing (no torch needed) -----------------------------------------------


def cell(record):
    if record is None:
        return "-"
    if record["status"] == "ok":
        return f"{record['gbps']:.1f}"
    return "FAILED" if record["status"] == "failed" else "n/a"


def merged_tables(ours, theirs, sizes):
    """One table per (mode, dtype): ours and theirs in GB/s, then each of ours over the best peer
    (the faster of torch and torch-compile at that N)."""
    index = {}
    for doc in (ours, theirs):
        for r in (doc or {}).get("results", []):
            index[(r["mode"], r["dtype"], r["provider"], r["m"], r["n"])] = r
    tables = []
    for mode in MODES:
        for dtype in DTYPES:
            rows_here = [(m, n) for (mo, d, m, n) in sizes if (mo, d) == (mode, dtype)]
            if not rows_here:
                continue
            ours_providers = ["ours"] if mode == "fwd" else ["ours-deterministic", "ours-locked"]
            header = ["", "N"] + ours_providers + PEERS + [f"{p} / best" for p in ours_providers]
            lines = []
            for i, (m, n) in enumerate(rows_here):
                get = lambda p: index.get((mode, dtype, p, m, n))  # noqa: E731
                peer_speeds = [get(p)["gbps"] for p in PEERS if get(p) and get(p)["status"] == "ok"]
                best = max(peer_speeds, default=None)
                ratios = []
                for p in ours_providers:
                    r = get(p)
                    ok = r is not None and r.get("status") == "ok"
                    ratios.append(f"{r['gbps'] / best:.2f}" if ok and best else "-")
                lines.append([str(i), str(n)] + [cell(get(p)) for p in ours_providers + PEERS] + ratios)
            m = rows_here[0][0]
            title = f"layer-norm-{'forward' if mode == 'fwd' else 'backward'} ({dtype}, M={m}), GB/s:"
            tables.append(title + "\n" + aligned(header, lines))
    return tables


def aligned(header, rows):
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    out = []
    for r in [header] + rows:
        out.append("".join(r[0].ljust(widths[0]) if c == 0 else "  " + r[c].rjust(widths[c]) for c in range(len(r))))
    return "\n".join(out)


def sizes_of(args, ours):
    """(mode, dtype, M, N) to measure: the flags, else what the ours JSON holds, else ln-bench's sweep."""
    if ours and args.n is None and not args.quick and args.rows is None:
        seen = []
        for r in ours["results"]:
            key = (r["mode"], r["dtype"], r["m"], r["n"])
            if key not in seen and r["mode"] in args.mode and r["dtype"] in args.dtype:
                seen.append(key)
        return seen
    ns = args.n or (QUICK_NS if args.quick else GPU_NS)
    rows = args.rows or 4096
    return [(mode, dtype, rows, n) for mode in args.mode for dtype in args.dtype for n in ns]


def comma_list(choices=None, kind=str):
    def parse(s):
        items = [kind(v) for v in s.split(",") if v]
        bad = [v for v in items if choices and v not in choices]
        if bad or not items or (kind is int and min(items) < 1):
            raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of {choices or 'positive integers'}")
        return items

    return parse


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", metavar="PATH", help="ln-bench --json output to merge with")
    p.add_argument("--theirs", metavar="PATH", help="a saved peers.py --json output: merge it, measure nothing")
    p.add_argument("--json", metavar="PATH", help="write the peers' numbers here")
    p.add_argument("--rows", type=int, help="M (default: as in --ours, else 4096)")
    p.add_argument("--n", type=comma_list(kind=int), help="comma list of N (default: as in --ours)")
    p.add_argument("--quick", action="store_true", help="N = 1024,4096,8192,32768")
    p.add_argument("--mode", type=comma_list(MODES), default=MODES)
    p.add_argument("--dtype", type=comma_list(DTYPES), default=DTYPES)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=20261122)
    args = p.parse_args()
    if args.reps < 1 or args.warmup < 0 or (args.rows is not None and args.rows < 1):
        p.error("--reps and --rows must be at least 1, --warmup at least 0")

    def load(path):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"cannot read {path}: {e}")

    ours = load(args.ours) if args.ours else None
    sizes = sizes_of(args, ours)
    theirs = load(args.theirs) if args.theirs else measure_all(args, sizes)
    if args.json and not args.theirs:
        with open(args.json, "w") as f:
            json.dump(theirs, f, indent=2)
    for doc, who in ((ours, "ours"), (theirs, "peers")):
        if doc:
            print(f"{who}: {doc['device']}, {doc['date']}, copy {doc['copy']['gbps']:.1f} GB/s")
    if ours and theirs and ours["device"].split("(")[-1].rstrip(")") != theirs["device"]:
        print("note: the two runs name different devices; ratios compare different machines")
    for table in merged_tables(ours, theirs, sizes):
        print("\n" + table)
    failed = [r for r in theirs["results"] if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
