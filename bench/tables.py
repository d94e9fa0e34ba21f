"""The tables and goals of ``bench.run``'s own benchmarks (1 to 4: round trip, one-way
tensor, fan-out, start-up), computed from the run's results alone, and the list of bench
modules that add sections of their own. ``bench.run`` prints them after a run;
``bench.report --doc PAGE`` writes them into a page from the JSON."""

from __future__ import annotations

from typing import Any

# Bench modules that contribute a section, tables, curves and targets (bench.curves says
# how); one not in this tree yet is skipped. --only names them by SECTION.
MODULES = ["bench.curves", "bench.idle", "bench.startup", "bench.notebook_code", "bench.overhead"]


def _ms(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "n/a"
    return f"{entry['median_ms']:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def _rate(gb: float, ms: float | None) -> str:
    return "n/a" if ms is None else f"{gb / (ms / 1e3):.2f}"


def _med(entry: dict[str, Any] | None) -> float | None:
    return None if not entry else entry["median_ms"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def arrays_table(xfer: dict[str, Any], target: Any, parts: list[str]) -> None:
    """2b: a NumPy array of the same size, through rpcnb (as a tensor) and pickled."""
    if not any("numpy" in size for size in xfer["sizes"].values()):
        return
    rows = [["2b. one-way NumPy array", "tensor (rpcnb) ms", "numpy ms", "numpy pickled ms",
             "numpy/tensor", "pickled/numpy", "numpy via shm"]]
    for mb, size in xfer["sizes"].items():
        rn, _ = rpcnb_column(size, xfer["shm"])
        npy, pk = _med(size.get("numpy")), _med(size.get("numpy pickled"))
        sends = size.get("shm_sends") or {}
        via = f"{sends.get('numpy', 0)}/{size['numpy']['n']}" if size.get("numpy") else "n/a"
        rows.append([f"{mb} MB", "n/a" if rn is None else f"{rn:.3f}", _ms(size.get("numpy")),
                     _ms(size.get("numpy pickled")), _ratio(npy, rn), _ratio(pk, npy), via])
        if mb in ("100", "512"):
            ok = None if npy is None or rn is None else npy <= 1.3 * rn
            target(f"{mb} MB: numpy array <= 1.3x torch CPU tensor", None if ok is None else npy / rn,
                   1.3, ok, "n/a" if ok is None else f"{npy / rn:.2f}x ({npy:.2f} vs {rn:.2f} ms)")
    parts.append(_table(rows) + "\n(numpy: np.ones(n, float32) sent with rpc_sync(worker1, consume_array, "
                 "args=(a,)), arriving as a NumPy array; pickled: the same with rpcnb.paths.arrays off, "
                 "its bytes in the pickle, as torch RPC sends it without rpcnb)")


def rpcnb_column(size: dict[str, Any], shm: str) -> tuple[float | None, str]:
    """The rpcnb figure and what to print when there is none (never a stand-in figure)."""
    if shm == "missing":
        return None, "n/a (shm path missing)"
    med = _med(size.get("rpcnb"))
    if med is None:
        return None, "n/a"
    sends = size.get("shm_sends")
    if sends is not None:
        taken, n = sends.get("rpcnb", 0), size["rpcnb"]["n"]
        if taken == 0:
            return None, "n/a (shm path not taken)"
        if taken < n:
            return med, f"{med:.3f} ({taken}/{n} via shm)"
    return med, f"{med:.3f}"


def report(results: dict[str, Any], cfg: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    parts: list[str] = []
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, limit: float | None, ok: bool | None, shown: str) -> None:
        verdict = "n/a" if ok is None else ("PASS" if ok else "MISS")
        targets.append({"target": name, "measured": value, "limit": limit, "verdict": verdict,
                        "shown": shown})

    rt = results.get("roundtrip", {})
    alone = results.get("roundtrip_ipp_alone", {})
    if rt or alone:
        base, px = _med(rt.get("rpc_sync")), _med(rt.get("%%px"))
        rows = [["1. no-op round trip (in kernel)", "median ms", "p10-p90 ms", "vs rpc_sync", "vs %%px"]]
        entries = list(rt.items()) + [(f"{name}, rpcnb group stopped", e) for name, e in alone.items()]
        for name, e in entries:
            rows.append([name, _ms(e), f"{e['p10_ms']:.3f}-{e['p90_ms']:.3f}",
                         _ratio(e["median_ms"], base), _ratio(e["median_ms"], px)])
        parts.append(_table(rows) + "\n(first rows measured in turns with an rpcnb group of 2 workers "
                     "and a cluster of 2 engines both up; 'rpcnb group stopped': ipyparallel alone)")
        rem = _med(rt.get("%%remote"))
        if rem is not None and base is not None:
            target("%%remote no-op <= raw rpc_sync + 2 ms", rem, base + 2.0, rem <= base + 2.0,
                   f"{rem:.3f} ms vs {base:.3f} + 2 = {base + 2:.3f} ms")
        nb = _med(rt.get("rpc_sync fn using torch (notebook)"))
        imp = _med(rt.get("rpc_sync fn using torch (importable)"))
        if nb is not None and imp is not None:
            target("notebook function using torch <= 1.2x importable one", nb / imp, 1.2,
                   nb / imp <= 1.2, f"{nb / imp:.2f}x ({nb:.3f} vs {imp:.3f} ms)")
        for label, ref in (("side by side", px), ("ipyparallel alone", _med(alone.get("%%px")))):
            if rem is not None and ref is not None:
                target(f"%%remote no-op <= 0.5x ipyparallel %px ({label})", rem / ref, 0.5,
                       rem <= 0.5 * ref, f"{rem / ref:.2f}x ({rem:.3f} vs {ref:.3f} ms)")
    cells = results.get("roundtrip_cells", {})
    if cells:
        empty = _med(cells.get("empty cell"))
        rows = [["1b. whole cell, front end", "median ms", "p10-p90 ms", "minus empty cell"]]
        for name, e in cells.items():
            extra = "" if empty is None or name == "empty cell" else f"{e['median_ms'] - empty:.3f}"
            rows.append([name, _ms(e), f"{e['p10_ms']:.3f}-{e['p90_ms']:.3f}", extra])
        parts.append(_table(rows))

    xfer = results.get("transfer")
    if xfer:
        rows = [["2. one-way CPU tensor", "tensorpipe ms", "rpcnb ms", "memcpy ms", "tp GB/s",
                 "rpcnb GB/s", "memcpy GB/s", "tp/rpcnb", "rpcnb/memcpy", "memcpy between calls ms"]]
        for mb, size in xfer["sizes"].items():
            gb = size["bytes"] / 1e9
            tp, cp = _med(size.get("tensorpipe")), _med(size.get("memcpy"))
            rn, rn_text = rpcnb_column(size, xfer["shm"])

            rows.append([f"{mb} MB", _ms(size.get("tensorpipe")), rn_text, _ms(size.get("memcpy")),
                         _rate(gb, tp), _rate(gb, rn), _rate(gb, cp), _ratio(tp, rn), _ratio(rn, cp),
                         _ms(size.get("memcpy between calls"))])
            if mb in ("100", "512"):
                if rn is None:
                    target(f"{mb} MB: rpcnb >= 8x faster than tensorpipe", None, 8.0, None, rn_text)
                    target(f"{mb} MB: rpcnb <= 2x memcpy", None, 2.0, None, rn_text)
                else:
                    assert tp is not None and cp is not None
                    target(f"{mb} MB: rpcnb >= 8x faster than tensorpipe", tp / rn, 8.0, tp / rn >= 8.0,
                           f"{tp / rn:.2f}x ({rn:.2f} vs {tp:.2f} ms)")
                    target(f"{mb} MB: rpcnb <= 2x memcpy", rn / cp, 2.0, rn / cp <= 2.0,
                           f"{rn / cp:.2f}x ({rn:.2f} vs {cp:.2f} ms)")
        parts.append(_table(rows) + "\n(MB = 2**20 bytes; GB/s = 1e9 bytes/s; time = round trip of "
                     "rpc_sync(worker1, consume, args=(t,)), which returns t.numel(); memcpy: dst.copy_(t) "
                     "back to back; 'between calls': the same copy taking turns with the sends)")
        arrays_table(xfer, target, parts)

    fan = results.get("fanout", {})
    if fan:
        rows = [["3. fan-out of a no-op", "raw rpc_async ms", "vs 1", "rpcnb.run ms", "vs 1",
                 "%%remote ms", "vs 1"]]
        r1, a1, m1 = _med(fan.get("raw 1")), _med(fan.get("api 1")), _med(fan.get("magic 1"))
        for n in cfg["fanout"]:
            r, a, m = _med(fan.get(f"raw {n}")), _med(fan.get(f"api {n}")), _med(fan.get(f"magic {n}"))
            rows.append([f"{n} worker{'s' if n > 1 else ''}", _ms(fan.get(f"raw {n}")), _ratio(r, r1),
                         _ms(fan.get(f"api {n}")), _ratio(a, a1),
                         _ms(fan.get(f"magic {n}")), _ratio(m, m1)])
        parts.append(_table(rows))
        m4 = _med(fan.get("magic 4"))
        if m4 is not None and m1 is not None:
            target("%%remote fan-out to 4 workers <= 1.5x 1 worker", m4 / m1, 1.5, m4 / m1 <= 1.5,
                   f"{m4 / m1:.2f}x ({m4:.3f} vs {m1:.3f} ms)")

    st = results.get("startup")
    if st:
        rows = [["4. fresh kernel to first result", "import/load s", "start s", "first result s",
                 "total s", "runs"]]
        for which, e in st.items():
            label = "rpcnb: %rpc_init --workers 2" if which == "rpcnb" else "ipyparallel: Cluster(n=2)"
            rows.append([label, f"{e['load_s_median']:.2f}", f"{e['init_s_median']:.2f}",
                         f"{e['first_result_s_median']:.3f}", f"{e['total_s_median']:.2f}",
                         " ".join(f"{run['total_s']:.2f}" for run in e["runs"])])
        r = st["rpcnb"]["total_s_median"] / st["ipyparallel"]["total_s_median"]
        parts.append(_table(rows) + f"\n(rpcnb / ipyparallel total: {r:.2f}x; medians of "
                     f"{len(st['rpcnb']['runs'])} runs each)")
        mine, theirs = st["rpcnb"]["total_s_median"], st["ipyparallel"]["total_s_median"]
        target("init to first result <= 0.5x ipyparallel", r, 0.5, r <= 0.5,
               f"{r:.2f}x ({mine:.2f} vs {theirs:.2f} s)")

    if targets:
        rows = [["goals", "verdict", "measured"]]
        rows += [[t["target"], t["verdict"], t["shown"]] for t in targets]
        parts.append(_table(rows))
    return "\n\n".join(parts), targets
