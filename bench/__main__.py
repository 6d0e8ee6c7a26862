"""``python -m bench [--quick] [--out FILE] [--only SECTION ...]``: run, print, write JSON.

``python -m bench soak [--minutes 30]``: the soak (bench/soak.py).

``python -m bench extender --real|--stand-in [--nodes 200] [--pods 1000]``: the
extender against the real kube-scheduler and API server of ../shared/realk8s,
or against the in-repo stand-ins (bench/extender_kit.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench import (
    admission,
    dra,
    extender,
    fastpath,
    footprint,
    hooks,
    packing,
    preload,
    scale,
    webhook,
)
from bench.common import Json, machine

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"


@dataclass(frozen=True)
class Plan:
    admissions: int
    scale_repeats: int
    churn: int
    idle_s: float
    arrivals: int
    settle_limit_s: float
    extender_nodes: int = 1000
    extender_slices: int = 20000
    extender_pods: int = 400
    preload: tuple[int, int, int] = (5, 1000, 40)  # rounds, /bin/true and python3 starts
    webhook_requests: int = 1000
    fast_admissions: int = 200
    fast_nodes: int = 200
    fast_pods: int = 1000


FULL = Plan(
    admissions=400, scale_repeats=3, churn=1000, idle_s=30.0, arrivals=4000, settle_limit_s=90.0
)
QUICK = Plan(
    admissions=60,
    scale_repeats=1,
    churn=100,
    idle_s=3.0,
    arrivals=300,
    settle_limit_s=15.0,
    extender_nodes=100,
    extender_slices=2000,
    extender_pods=100,
    preload=(1, 50, 2),
    webhook_requests=200,
    fast_admissions=30,
    fast_nodes=20,
    fast_pods=100,
)


def sections(plan: Plan) -> dict[str, Callable[[], Json]]:
    return {
        "admission": lambda: admission.run(plan.admissions),
        "scale": lambda: scale.run(plan.scale_repeats),
        "footprint": lambda: footprint.run(plan.churn, plan.idle_s, plan.settle_limit_s),
        "packing": lambda: packing.run(plan.arrivals),
        "hooks": hooks.run,
        "dra": lambda: dra.run(plan.admissions // 2),
        "extender": lambda: extender.run(
            plan.extender_nodes, plan.extender_slices, plan.extender_pods
        ),
        "preload": lambda: preload.run(*plan.preload),
        "webhook": lambda: webhook.run(plan.webhook_requests),
        "fastpath": lambda: fastpath.run(plan.fast_admissions, plan.fast_nodes, plan.fast_pods),
    }


# ------------------------------------------------------------------------------- printing


def _rows_admission(r: Json) -> list[list[str]]:
    rows = [["", "vgpu p50", "vgpu p99", "null p50", "null p99", "p50 x", "p99 x"]]
    for kind, ratio in r["ratios"].items():
        v, n = r["vgpu"][kind], r["null"][kind]
        rows.append(
            [
                f"{kind} (ms)",
                f"{v['p50_ms']:.2f}",
                f"{v['p99_ms']:.2f}",
                f"{n['p50_ms']:.2f}",
                f"{n['p99_ms']:.2f}",
                f"{ratio['p50']:.2f}",
                f"{ratio['p99']:.2f}",
            ]
        )
    return rows


def _rows_scale(r: Json) -> list[list[str]]:
    rows = [["shape", "core IDs", "memory IDs", "core msg B", "memory msg B", "start s"]]
    for s in r["shapes"]:
        rows.append(
            [
                s["shape"],
                str(s["devices"]["vcuda-core"]),
                str(s["devices"]["vcuda-memory"]),
                str(s["message_bytes"]["vcuda-core"]),
                str(s["message_bytes"]["vcuda-memory"]),
                f"{s['startup_s']:.2f}",
            ]
        )
    return rows


def _rows_footprint(r: Json) -> list[list[str]]:
    return [
        ["RSS MiB: start", "half", "end", "growth", "idle CPU %", "threads"],
        [
            f"{r['rss_start_mib']:.1f}",
            f"{r['rss_half_mib']:.1f}",
            f"{r['rss_end_mib']:.1f}",
            f"{r['rss_growth_mib']:+.2f}",
            f"{r['idle_cpu_percent']:.3f}",
            str(r["threads"]),
        ],
    ]


def _rows_packing(r: Json) -> list[list[str]]:
    rows = [
        ["load", "policy", "arrivals", "frag refused", "capacity refused", "core util", "mem util"]
    ]
    for run in r["runs"]:
        rows.append(
            [
                f"{run['load']:.1f}",
                run["policy"],
                str(run["arrivals"]),
                f"{run['fragmentation_share'] * 100:.1f}%",
                str(run["capacity_refusals"]),
                f"{run['mean_core_utilisation'] * 100:.1f}%",
                f"{run['mean_memory_utilisation'] * 100:.1f}%",
            ]
        )
    return rows


def _rows_hooks(r: Json) -> list[list[str]]:
    if not r.get("available"):
        return [["not available", r.get("reason", "")]]
    return [[k, f"{v} ns"] for k, v in r["metrics"].items()]


def _rows_preload(r: Json) -> list[list[str]]:
    if not r.get("available"):
        return [["not available", r.get("reason", "")]]
    return [[k, str(v)] for k, v in r["metrics"].items()]


def _rows_dra(r: Json) -> list[list[str]]:
    rows = [["NodePrepareResources", "calls", "p50 ms", "p99 ms", "max ms"]]
    for name in ("prepare_one_claim", "prepare_pod_of_8_claims"):
        v = r[name]
        rows.append(
            [
                name,
                str(v["calls"]),
                f"{v['p50_ms']:.2f}",
                f"{v['p99_ms']:.2f}",
                f"{v['max_ms']:.2f}",
            ]
        )
    p = r["publication_s"]
    rows.append(
        [
            "slice after health change (s)",
            str(p["changes"]),
            f"{p['p50_s']:.3f}",
            f"{p['p99_s']:.3f}",
            f"{p['max_s']:.3f}",
        ]
    )
    return rows


def _rows_extender(r: Json) -> list[list[str]]:
    rows = [["", "vgpu p50", "vgpu p99", "null p50", "null p99", "p99 x"]]
    for verb in ("filter", "prioritize", "bind"):
        v, n = r["vgpu"][verb], r["null"][verb]
        rows.append(
            [
                f"{verb} (ms)",
                f"{v['p50_ms']:.2f}",
                f"{v['p99_ms']:.2f}",
                f"{n['p50_ms']:.3f}",
                f"{n['p99_ms']:.3f}",
                f"{r['p99_ratio_vs_null'][verb]:.1f}",
            ]
        )
    pick = r["vgpu_picking"]
    for verb in ("filter", "bind"):
        v = pick[verb]
        rows.append(
            [f"{verb}, picking (ms)", f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", "", "", ""]
        )
    rows.append(["pods/s", str(r["vgpu"]["pods_per_s"]), "", str(r["null"]["pods_per_s"]), "", ""])
    rows.append(["pods/s, picking", str(pick["pods_per_s"]), "", "", "", ""])
    rows.append(["RSS MiB", str(r["rss_mib"]), "", "", "", ""])
    return rows


def _rows_webhook(r: Json) -> list[list[str]]:
    rows = [["", "kept-alive p50/p99 ms", "new conn p50/p99 ms", "handler p50/p99 ms"]]
    for name in ("validate", "mutate"):
        k, n, h = r[name]["kept_alive"], r[name]["new_connection"], r[name]["handler"]
        rows.append(
            [
                f"/{name}",
                f"{k['p50_ms']:.2f} / {k['p99_ms']:.2f}",
                f"{n['p50_ms']:.2f} / {n['p99_ms']:.2f}",
                f"{h['p50_ms']:.3f} / {h['p99_ms']:.3f}",
            ]
        )
    return rows


def _rows_fastpath(r: Json) -> list[list[str]]:
    n, c, law, e = r["node"], r["checkpoint"], r["listandwatch"], r["extender"]
    rows = [["", "vgpu", "baseline", "ratio"]]
    for key in ("first", "p50", "p99"):
        rows.append(
            [
                f"pod admission {key} (ms)",
                f"{n['vgpu'][f'{key}_ms']:.2f}",
                f"{n['null'][f'{key}_ms']:.2f}",
                f"{n['ratios'][key]}",
            ]
        )
    for shape in c["shapes"]:
        rows.append(
            [
                f"checkpoint B, {shape['gpus']}",
                str(shape["bytes"]),
                str(shape["legacy_bytes"]),
                str(shape["ratio"]),
            ]
        )
    for row in law["memory"]:
        rows.append(
            [
                f"ListAndWatch B, 16xH200 {row['unit_mib']} MiB",
                str(row["bytes"]),
                str(row["legacy_bytes"]),
                str(round(row["bytes"] / row["legacy_bytes"], 3)),
            ]
        )
    rows.append(
        [
            f"pods/s, {e['nodes']} nodes, {e['pods']} pods (median of {e['rounds']} rounds:"
            f" {', '.join(str(x) for x in e['ratios'])})",
            str(e["vgpu"]["pods_per_s"]),
            str(e["baseline"]["pods_per_s"]),
            str(e["ratio"]),
        ]
    )
    rows.append([f"{e['burst']['pods']}-pod burst (s)", str(e["burst"]["seconds"]), "", ""])
    return rows


ROWS: dict[str, Callable[[Json], list[list[str]]]] = {
    "admission": _rows_admission,
    "scale": _rows_scale,
    "footprint": _rows_footprint,
    "packing": _rows_packing,
    "hooks": _rows_hooks,
    "dra": _rows_dra,
    "extender": _rows_extender,
    "preload": _rows_preload,
    "webhook": _rows_webhook,
    "fastpath": _rows_fastpath,
}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in rows
    )


def render(results: Json) -> str:
    out: list[str] = []
    for name, section in results["sections"].items():
        out.append(f"\n== {name} ({section.get('seconds', 0):.1f} s)")
        if "error" in section:
            out.append(f"  ERROR: {section['error']}")
            continue
        out.append(_table(ROWS[name](section)))
        for t in section.get("targets", []):
            verdict = "PASS" if t["passed"] else "MISS"
            out.append(
                f"  [{verdict}] {t['name']}: {t['value']} {t['unit']} (target <= {t['limit']})"
            )
    return "\n".join(out)


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:  # python -m bench soak [--minutes N]: see bench/soak.py
        from bench import soak

        return soak.main(argv[1:])
    if argv[:1] == ["extender"]:  # python -m bench extender --real|--stand-in ...
        from bench import extender_kit

        return extender_kit.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts (CI, under a minute)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file ({DEFAULT_OUT})")
    parser.add_argument(
        "--only", nargs="+", choices=list(ROWS), metavar="SECTION", help="run only these"
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    results: Json = {
        "meta": {
            "mode": "quick" if args.quick else "full",
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "plan": plan.__dict__,
        },
        "sections": {},
    }
    for name, fn in sections(plan).items():
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            section = fn()
        except Exception as exc:  # a broken section is reported, the others still run
            section = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        section["seconds"] = round(time.perf_counter() - t0, 2)
        results["sections"][name] = section
    results["meta"]["seconds"] = round(time.perf_counter() - started, 2)
    targets = [t for s in results["sections"].values() for t in s.get("targets", [])]
    results["summary"] = {
        "targets": len(targets),
        "passed": sum(1 for t in targets if t["passed"]),
        "missed": [t["name"] for t in targets if not t["passed"]],
        "errors": [n for n, s in results["sections"].items() if "error" in s],
    }
    print(render(results))
    summary = results["summary"]
    print(
        f"\n{summary['passed']}/{summary['targets']} targets met"
        + (f"; errors in {', '.join(summary['errors'])}" if summary["errors"] else "")
        + f"; {results['meta']['seconds']:.1f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"JSON written to {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
