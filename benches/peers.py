#!/usr/bin/env python3
"""The peers' LayerNorm (or RMSNorm), timed as ln-bench times ours, and a merged table per
(mode, dtype, M) with ours / theirs. Peers: PyTorch (eager, and under torch.compile), Liger
Kernel's LigerLayerNormFunction, and the Triton tutorial's kernels (its forward and its locked
backward with atomic-CAS spinlocks over G groups; rows up to 64 KB). With --norm rms:
F.rms_norm (eager and compiled) and Liger's LigerRMSNormFunction; the tutorial has no RMSNorm.
With --residual, the residual add of a pre-norm block with the norm, as ln-bench --residual
measures ours: s = x + residual and y = norm(s), forward and backward (the backward takes dy
and dsum, the gradient reaching s from the residual stream); PyTorch as `x + r` then the norm
(eager, and under torch.compile, which fuses them), and for RMSNorm Liger's
LigerFusedAddRMSNormFunction; Liger has no such LayerNorm, nor the tutorial. With
--residual --f32-stream, as ln-bench --f32-stream: the residual, s and dsum in f32 beside
f16/bf16 x; PyTorch as `x.float() + r`, the norm in f32 and y cast back to x's dtype (eager
and compiled), flash-attention's residual_in_fp32 written out; Liger's fused add takes one
dtype and is not measured.

    python3 benches/peers.py --ours ours.json [--json peers.json]
    python3 benches/peers.py --ours ours.json --theirs peers.json   # merge saved results only
    python3 benches/peers.py --preset llm --json peers.json \
        --triton-tutorial PATH/05-layer-norm.py                     # before ln-bench --peers
    python3 benches/peers.py --norm rms --quick --ours rms.json     # ln-bench --norm rms --json

Liger Kernel: `pip install liger-kernel` (0.8.5 measured; a pure-Python wheel, so on a machine
without network `pip download --no-deps liger-kernel==0.8.5` elsewhere, then `pip install
--no-deps --target DIR` and PYTHONPATH=DIR). The Triton tutorial is not part of this
repository: pass its file, python/tutorials/05-layer-norm.py of
https://github.com/triton-lang/triton, with --triton-tutorial. A peer that cannot be imported
is reported as missing, with the reason, and the others are measured.

Presets, as in ln-bench: --preset llm (bf16, M = 16384, 65536, N = 768, 1024, 2048, 4096, 5120,
8192) and --preset latency (bf16, M = 1, 8, 64, 512, N = 4096, 8192; tables in microseconds).

Timing as ln-bench and triton.testing.do_bench: CUDA events around the call, warm-up first,
a 256 MiB buffer written between repetitions (outside the timed region) to flush L2, median
and 20%/80% quantiles. GB/s: forward 2*M*N*bytes, backward 3*M*N*bytes (with --residual
4*M*N*bytes both ways: x, residual, s, y; s, dy, dsum, dx; with --f32-stream the residual,
s, dsum and the residual's gradient at 4 bytes: forward M*N*(2*bytes + 8), backward
M*N*(2*bytes + 12)); the backward is
y.backward(dy, retain_graph=True) (with --residual, torch.autograd.backward([y, s], [dy,
dsum], retain_graph=True)) with dgamma and dbeta computed, gradients reset to None
between repetitions (outside the timed region) so that none is accumulated. Each
configuration is checked against float64 first; a wrong one is reported FAILED, not timed;
one a peer cannot run (the tutorial past 64 KB rows) is n/a.

--floor also times, for each configuration, a plain streaming kernel of the same bytes
(provider "floor"): y = 1.5 * x forward (one tensor read, one written) and dx = x + dy
backward (two read, one written), PyTorch's elementwise kernels, timed the same way. No norm
timed this way moves its bytes faster, so "ours / floor" bounds what any kernel can gain at
that shape (the L2 flush and the launch weigh on short calls: at M = 4096, N = 4096 in
16-bit the backward's floor is about 80% of the copy). The floor is not a peer: it takes
no part in "best". Not with --residual.
Needs PyTorch with CUDA, except with --theirs.
"""

import argparse
import ast
import json
import sys
import types
from datetime import datetime, timezone

GPU_NS = [512 * i for i in range(2, 32)] + [32768, 65536]
QUICK_NS = [1024, 4096, 8192, 32768]
DTYPES = ["f16", "bf16", "f32"]
MODES = ["fwd", "bwd"]
PEERS = ["torch", "torch-compile", "liger", "triton-tutorial"]
FLOOR = "floor"
NORMS = ["layer", "rms"]
PRESETS = {
    "llm": {"dtypes": ["bf16"], "rows": [16384, 65536], "ns": [768, 1024, 2048, 4096, 5120, 8192]},
    "latency": {"dtypes": ["bf16"], "rows": [1, 8, 64, 512], "ns": [4096, 8192]},
}
EPS = 1e-5
FLUSH_BYTES = 256 << 20
# GPU clock cycles each repetition waits after the flush, before its start event: about 1 ms
# at the H200's 1.98 GHz, time for the host to queue the events and the op (a Triton launch
# from Python takes tens of microseconds, more on a busy host), so that throughput tables
# time the kernels, as ours (a Rust launch of a few microseconds) is timed behind the flush
# alone. Not in the latency preset, whose times keep the host work that outlasts the flush.
QUEUE_AHEAD_CYCLES = 2_000_000
COPY_BYTES = 1 << 30
BYTES = {"f16": 2, "bf16": 2, "f32": 4}
UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24}


def tolerance(dtype):
    """As ln-bench: four unit roundoffs of the storage type, at least 1e-4."""
    return max(4 * UNIT_ROUNDOFF[dtype], 1e-4)


def moved_bytes(mode, dtype, m, n, residual, f32_stream=False):
    if residual and f32_stream:
        return m * n * (2 * BYTES[dtype] + (8 if mode == "fwd" else 12))
    tensors = 4 if residual else (2 if mode == "fwd" else 3)
    return tensors * m * n * BYTES[dtype]


def quantiles(ms):
    """Median, 20% and 80%, interpolated linearly between order statistics (as torch.quantile)."""
    ms = sorted(ms)

    def at(q):
        pos = q * (len(ms) - 1)
        lo, hi = int(pos), min(int(pos) + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

    return {"median_ms": at(0.5), "p20_ms": at(0.2), "p80_ms": at(0.8)}


# --- measuring (needs torch) ---------------------------------------------------------------


def time_cuda(torch, op, warmup, reps, before=None, queue_ahead=True):
    """Quantiles of `op`'s time in ms; `before` runs ahead of each repetition, untimed;
    `queue_ahead`: the GPU waits `QUEUE_AHEAD_CYCLES` before each start event."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        op()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if before:
            before()
        flush.zero_()
        if queue_ahead:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
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


# --- the peers (each imported only when asked for) ----------------------------------------


def import_definitions(path, name):
    """A tutorial script's definitions as a module, without running the script.

    Triton's tutorials are scripts: below their definitions they call their own test and
    benchmark at the top level (05-layer-norm.py ends in `test_layer_norm(1151, 8192,
    torch.float16)` and `bench_layer_norm.run(...)`). Here the file is parsed and only its
    top-level imports, try blocks (the tutorial's optional `import apex`), assignments, and
    function and class definitions are run; expression statements (those calls, the
    docstring) and any other top-level statement are dropped. The kept code is compiled under
    the file's own name with its line numbers, so `triton.jit` reads each kernel's source from
    the file as it would on a plain import."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    kept = (ast.Import, ast.ImportFrom, ast.Try, ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.ClassDef)
    tree.body = [stmt for stmt in tree.body if isinstance(stmt, kept)]
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module  # where triton.jit and inspect look a function's module up
    exec(compile(tree, path, "exec"), module.__dict__)
    return module


def torch_norm(F, norm, n, residual=False, f32_stream=False):
    """PyTorch's functional norm over rows of n: layer_norm(x, w, b) or rms_norm(x, w); with
    `residual`, (norm(s), s) of s = x + r, taking (x, r, w[, b]); with `f32_stream`, s = x
    widened to r's type (f32) + r, normalized with the weights widened, y cast to x's type."""
    if norm == "layer":
        normalize = lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
    else:
        normalize = lambda x, w: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
    if not residual:
        return normalize

    def add_and_normalize(x, r, *weights):
        s = x + r
        return normalize(s, *weights), s

    def add_and_normalize_wide(x, r, *weights):
        s = x.to(r.dtype) + r
        return normalize(s, *(w.to(r.dtype) for w in weights)).to(x.dtype), s

    return add_and_normalize_wide if f32_stream else add_and_normalize


def torch_eager(args, torch, F):
    return lambda n: torch_norm(F, args.norm, n, args.residual, args.f32_stream)


def torch_compiled(args, torch, F):
    def for_rows_of(n):
        torch._dynamo.reset()  # a fresh static compile per size, no recompile limit
        return torch.compile(torch_norm(F, args.norm, n, args.residual, args.f32_stream), dynamic=False)

    return for_rows_of


def liger(args, torch, F):
    if args.residual:
        if args.norm == "layer":
            raise NotImplementedError("Liger has no LayerNorm with the residual add")
        if args.f32_stream:
            raise NotImplementedError("Liger's fused add RMSNorm takes x and the residual of one dtype")
        from liger_kernel.ops import LigerFusedAddRMSNormFunction

        # (y, s) of s = x + r; offset 0, the default casting, not in place (as below).
        return lambda n: lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
    if args.norm == "layer":
        from liger_kernel.ops import LigerLayerNormFunction

        return lambda n: lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    from liger_kernel.ops import LigerRMSNormFunction

    # offset 0 and Liger's default casting ("llama"); in_place=False, because in place its
    # backward writes dx over dy, which every repetition here reuses.
    return lambda n: lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def triton_tutorial(args, torch, F):
    if args.norm != "layer" or args.residual:
        raise NotImplementedError("the Triton tutorial has LayerNorm only, without the residual add")
    if not args.triton_tutorial:
        raise FileNotFoundError(
            "no --triton-tutorial PATH given (python/tutorials/05-layer-norm.py of github.com/triton-lang/triton)"
        )
    tutorial = import_definitions(args.triton_tutorial, "triton_tutorial_layer_norm")
    if not hasattr(tutorial, "LayerNorm"):
        raise ImportError(f"{args.triton_tutorial} defines no LayerNorm autograd function")
    return lambda n: lambda x, w, b: tutorial.LayerNorm.apply(x, (n,), w, b, EPS)


IMPORTERS = {"torch": torch_eager, "torch-compile": torch_compiled, "liger": liger, "triton-tutorial": triton_tutorial}


def import_peers(args, torch, F):
    """For each peer asked for: `for_rows_of(n)`, giving layer_norm(x, w, b) over rows of n, or,
    where it cannot be imported, the reason."""
    found, missing = {}, {}
    for peer in args.peers:
        try:
            found[peer] = IMPORTERS[peer](args, torch, F)
        except Exception as e:  # a missing package, a file that is not the tutorial: report, go on
            missing[peer] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return found, missing


# --- measuring (needs torch) ---------------------------------------------------------------


def torch_dtype(torch, dtype):
    return {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]


def passes_check(record, err, dtype):
    """Records the check's relative error; where it misses the tolerance, marks the record
    failed (not to be timed) and returns False."""
    record["check_error"] = err if err != float("inf") else None
    if err <= tolerance(dtype):
        return True
    record.update(status="failed", failure=f"relative error {err:.2e} > tolerance {tolerance(dtype):.1e}")
    return False


def timed(record, time, moved):
    """The record of a configuration that moved `moved` bytes in `time`'s median."""
    record.update(status="ok", gbps=moved / (time["median_ms"] * 1e-3) / 1e9, **time)
    return record


def measure(
    torch, F, norm, residual, mode, dtype, m, n, peer, for_rows_of, warmup, reps, seed, f32_stream=False, queue_ahead=True
):
    """One configuration: check against float64, then time. Returns a result record."""
    tdtype = torch_dtype(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spread = 10 ** (torch.rand(m, 1, device="cuda", generator=gen) * 2 - 1)
    offset = spread * (torch.rand(m, 1, device="cuda", generator=gen) * 4 - 2)
    x = (offset + spread * (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1)).to(tdtype)
    dy = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(tdtype)
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(tdtype)
    b = (torch.rand(n, device="cuda", generator=gen) - 0.5).to(tdtype)
    if residual:
        rdtype = torch.float32 if f32_stream else tdtype
        r = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(rdtype)
        dsum = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(rdtype)
    record = {"mode": mode, "dtype": dtype, "provider": peer, "m": m, "n": n, "tolerance": tolerance(dtype)}

    try:
        normalize = for_rows_of(n)
        operands = ((x, r) if residual else (x,)) + ((w, b) if norm == "layer" else (w,))
        leaves = [t.detach().requires_grad_(mode == "bwd") for t in operands]
        ref_leaves = [t.detach().double().requires_grad_(mode == "bwd") for t in operands]
        # The outputs and their gradients: y (and s, with the residual add).
        outs = normalize(*leaves)
        ref_outs = torch_norm(F, norm, n, residual, f32_stream)(*ref_leaves)
        if not residual:
            outs, ref_outs = (outs,), (ref_outs,)
        grads = (dy, dsum) if residual else (dy,)
        if mode == "fwd":
            err = max(rel_err(o, ref) for o, ref in zip(outs, ref_outs))
            op = lambda: normalize(*leaves)  # noqa: E731
            before = None
        else:
            torch.autograd.backward(outs, grads, retain_graph=True)
            torch.autograd.backward(ref_outs, [g.double() for g in grads])
            err = max(rel_err(t.grad, ref.grad) for t, ref in zip(leaves, ref_leaves))
            op = lambda: torch.autograd.backward(outs, grads, retain_graph=True)  # noqa: E731

            def before():
                for t in leaves:
                    t.grad = None

        del ref_outs, ref_leaves  # float64 copies: free them before timing
        if not passes_check(record, err, dtype):
            return record
        time = time_cuda(torch, op, warmup, reps, before, queue_ahead)
    except Exception as e:  # a peer that cannot run this shape (compile error, 64 KB rows): report, go on
        record.update(status="n/a", failure=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return record
    return timed(record, time, moved_bytes(mode, dtype, m, n, residual, f32_stream))


def measure_floor(torch, mode, dtype, m, n, warmup, reps, seed, queue_ahead=True):
    """The same bytes as one configuration of the norm, streamed by PyTorch's elementwise
    kernels: y = 1.5 * x (forward) or dx = x + dy (backward), checked against float64 first,
    timed as `measure` times the peers."""
    tdtype = torch_dtype(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(tdtype)
    dy = (torch.rand(m, n, device="cuda", generator=gen) * 2 - 1).to(tdtype)
    out = torch.empty_like(x)
    if mode == "fwd":
        op = lambda: torch.mul(x, 1.5, out=out)  # noqa: E731
        ref = x.double() * 1.5
    else:
        op = lambda: torch.add(x, dy, out=out)  # noqa: E731
        ref = x.double() + dy.double()
    record = {"mode": mode, "dtype": dtype, "provider": FLOOR, "m": m, "n": n, "tolerance": tolerance(dtype)}
    op()
    err = rel_err(out, ref)
    del ref
    if not passes_check(record, err, dtype):
        return record
    return timed(record, time_cuda(torch, op, warmup, reps, None, queue_ahead), moved_bytes(mode, dtype, m, n, False))


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
    peers, missing = import_peers(args, torch, F)
    run = {
        "norm": args.norm,
        "residual": args.residual,
        "f32_stream": args.f32_stream,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "preset": args.preset,
        "copy": copy,
        "reps": args.reps,
        "warmup": args.warmup,
        "missing": missing,
        "results": [],
    }
    print(f"peers: {run['device']}, torch {run['torch']}, copy {copy['gbps']:.1f} GB/s", file=sys.stderr)
    for peer, why in missing.items():
        print(f"peers: {peer} is missing: {why}", file=sys.stderr)

    def note(i, r):
        run["results"].append(r)
        shown = f"{r['gbps']:.1f} GB/s" if r["status"] == "ok" else r["status"] + " " + r.get("failure", "")
        where = f"{r['mode']} {r['dtype']} M={r['m']} N={r['n']} {r['provider']}"
        print(f"[{i + 1}/{len(sizes)}] {where}: {shown}", file=sys.stderr)

    for i, (mode, dtype, m, n) in enumerate(sizes):
        for peer, for_rows_of in peers.items():
            r = measure(
                torch,
                F,
                args.norm,
                args.residual,
                mode,
                dtype,
                m,
                n,
                peer,
                for_rows_of,
                args.warmup,
                args.reps,
                args.seed,
                args.f32_stream,
                args.preset != "latency",
            )
            note(i, r)
        if args.floor:
            note(i, measure_floor(torch, mode, dtype, m, n, args.warmup, args.reps, args.seed, args.preset != "latency"))
        torch.cuda.empty_cache()
    return run


# --- merging and printing (no torch needed) -----------------------------------------------


def cell(record, latency):
    """Median microseconds (latency tables) or GB/s; else why there is none."""
    if record is None:
        return "-"
    if record["status"] == "ok":
        return f"{record['median_ms'] * 1e3:.2f}" if latency else f"{record['gbps']:.1f}"
    return "FAILED" if record["status"] == "failed" else "n/a"


def merged_tables(ours, theirs, sizes, latency, norm, residual, f32_stream=False):
    """One table per (mode, dtype, M) in GB/s, or per (mode, dtype) in median microseconds
    for the latency preset: ours and the peers, then each of ours over the best peer (its
    speed over the fastest peer's at that shape: above 1, ours is faster); where the peers'
    run timed the floor (--floor), its column and each of ours over it."""
    index = {}
    for doc in (ours, theirs):
        for r in (doc or {}).get("results", []):
            index[(r["mode"], r["dtype"], r["provider"], r["m"], r["n"])] = r
    peers = [p for p in PEERS if any(r["provider"] == p for r in (theirs or {}).get("results", []))]
    floors = [FLOOR] if any(r["provider"] == FLOOR for r in (theirs or {}).get("results", [])) else []
    empty = (ours or {}).get("empty_kernel")
    tables = []
    for mode in MODES:
        for dtype in DTYPES:
            shapes = [(m, n) for (mo, d, m, n) in sizes if (mo, d) == (mode, dtype)]
            groups = [shapes] if latency else [[s for s in shapes if s[0] == m] for m in dict.fromkeys(m for m, _ in shapes)]
            for group in filter(None, groups):
                ours_providers = ["ours"] if mode == "fwd" else ["ours-deterministic", "ours-locked"]
                shape_columns = ["M", "N"] if latency else ["N"]
                header = [""] + shape_columns + ours_providers + peers + floors + [f"{p} / best" for p in ours_providers]
                header += [f"{p} / {f}" for f in floors for p in ours_providers]
                lines = []
                for i, (m, n) in enumerate(group):
                    get = lambda p: index.get((mode, dtype, p, m, n))  # noqa: E731
                    best = min((get(p)["median_ms"] for p in peers if get(p) and get(p)["status"] == "ok"), default=None)
                    ratios = []
                    for bound in [best] + [get(f)["median_ms"] if get(f) and get(f)["status"] == "ok" else None for f in floors]:
                        for p in ours_providers:
                            r = get(p)
                            ok = r is not None and r.get("status") == "ok"
                            ratios.append(f"{bound / r['median_ms']:.2f}" if ok and bound else "-")
                    shape = [str(m), str(n)] if latency else [str(n)]
                    shown = ours_providers + peers + floors
                    lines.append([str(i)] + shape + [cell(get(p), latency) for p in shown] + ratios)
                stream = "-f32" if residual and f32_stream else ""
                name = f"{norm}-norm{'-residual' if residual else ''}{stream}-{'forward' if mode == 'fwd' else 'backward'}"
                if latency:
                    unit = "median microseconds" + (f"; empty kernel {empty['median_ms'] * 1e3:.2f}" if empty else "")
                    title = f"{name} ({dtype}), {unit}:"
                else:
                    title = f"{name} ({dtype}, M={group[0][0]}), GB/s:"
                tables.append(title + "\n" + aligned(header, lines))
    return tables


def aligned(header, rows):
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    out = []
    for r in [header] + rows:
        out.append("".join(r[0].ljust(widths[0]) if c == 0 else "  " + r[c].rjust(widths[c]) for c in range(len(r))))
    return "\n".join(out)


def sizes_of(args, ours):
    """(mode, dtype, M, N) to measure: the flags and the preset, else what the ours JSON holds,
    else ln-bench's sweep."""
    dtypes = args.dtype or (PRESETS[args.preset]["dtypes"] if args.preset else DTYPES)
    if ours and args.n is None and not args.quick and args.rows is None and args.preset is None:
        seen = []
        for r in ours["results"]:
            key = (r["mode"], r["dtype"], r["m"], r["n"])
            if key not in seen and r["mode"] in args.mode and r["dtype"] in dtypes:
                seen.append(key)
        return seen
    preset = PRESETS.get(args.preset, {})
    ns = args.n or preset.get("ns") or (QUICK_NS if args.quick else GPU_NS)
    rows = args.rows or preset.get("rows") or [4096]
    return [(mode, dtype, m, n) for mode in args.mode for dtype in dtypes for m in rows for n in ns]


def comma_list(choices=None, kind=str):
    def parse(s):
        items = list(dict.fromkeys(kind(v) for v in s.split(",") if v))
        bad = [v for v in items if choices and v not in choices]
        if bad or not items or (kind is int and min(items) < 1):
            raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of {choices or 'positive integers'}")
        return items

    return parse


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", metavar="PATH", help="ln-bench --json output to merge with")
    p.add_argument("--theirs", metavar="PATH", help="a saved peers.py --json output: merge it, measure nothing")
    p.add_argument("--json", metavar="PATH", help="write the peers' numbers here (what ln-bench --peers reads)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="shapes and tables as ln-bench --preset")
    p.add_argument("--rows", type=comma_list(kind=int), help="comma list of M (default: the preset's, else 4096)")
    p.add_argument("--n", type=comma_list(kind=int), help="comma list of N (default: as in --ours, else the preset's)")
    p.add_argument("--quick", action="store_true", help="N = 1024,4096,8192,32768")
    p.add_argument("--norm", choices=NORMS, default="layer", help="layer (LayerNorm) or rms (RMSNorm)")
    p.add_argument("--residual", action="store_true", help="the residual add with the norm (as ln-bench --residual)")
    p.add_argument(
        "--f32-stream", action="store_true", help="with --residual: the stream in f32 (as ln-bench --f32-stream)"
    )
    p.add_argument("--mode", type=comma_list(MODES), default=MODES)
    p.add_argument("--dtype", type=comma_list(DTYPES), help="default: the preset's, else f16,bf16,f32")
    p.add_argument("--peers", type=comma_list(PEERS), default=PEERS, help=f"peers to measure (default: {','.join(PEERS)})")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time a streaming kernel of each configuration's bytes (y = 1.5 x, dx = x + dy): the floor",
    )
    p.add_argument(
        "--triton-tutorial",
        metavar="PATH",
        help="the Triton tutorial's python/tutorials/05-layer-norm.py (github.com/triton-lang/triton); "
        "only its definitions are run, not its test and benchmark",
    )
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=20261122)
    args = p.parse_args()
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be at least 1, --warmup at least 0")
    if args.preset and args.quick:
        p.error("--quick and --preset choose N both: give one")
    if args.f32_stream and not args.residual:
        p.error("--f32-stream is the residual add's stream: give --residual too")
    if args.floor and args.residual:
        p.error("--floor streams the plain norm's tensors; the residual add moves four a pass")

    def load(path):
        """A saved run of this norm, with the residual add or without as asked (files from before
        --norm hold LayerNorm, and from before --residual the norm alone)."""
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"cannot read {path}: {e}")
        if doc.get("norm", "layer") != args.norm:
            p.error(f"{path} measured {doc.get('norm', 'layer')}-norm, not {args.norm}-norm (--norm)")
        if doc.get("residual", False) != args.residual:
            with_or = "with" if doc.get("residual", False) else "without"
            p.error(f"{path} measured the norm {with_or} the residual add (--residual)")
        if doc.get("f32_stream", False) != args.f32_stream:
            kept = "in f32" if doc.get("f32_stream", False) else "in x's dtype"
            p.error(f"{path} measured the residual stream {kept} (--f32-stream)")
        return doc

    ours = load(args.ours) if args.ours else None
    sizes = sizes_of(args, ours)
    theirs = load(args.theirs) if args.theirs else measure_all(args, sizes)
    if args.json and not args.theirs:
        with open(args.json, "w") as f:
            json.dump(theirs, f, indent=2)
    for doc, who in ((ours, "ours"), (theirs, "peers")):
        if doc:
            print(f"{who}: {doc['device']}, {doc['date']}, copy {doc['copy']['gbps']:.1f} GB/s")
    for peer, why in theirs.get("missing", {}).items():
        print(f"peers: {peer} not measured ({why})")
    if ours and theirs and ours["device"].split("(")[-1].rstrip(")") != theirs["device"]:
        print("note: the two runs name different devices; ratios compare different machines")
    latency = "latency" in (args.preset, (ours or {}).get("preset"), theirs.get("preset"))
    for table in merged_tables(ours, theirs, sizes, latency, args.norm, args.residual, args.f32_stream):
        print("\n" + table)
    failed = [r for r in theirs["results"] if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
