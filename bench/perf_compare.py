#!/usr/bin/env python3
"""perf_compare.py - compares one recorded GPU performance result (bench/results/*.json, written
by bench/perf_check.py) with the newest earlier one, figure by figure, against the ceilings each
run measured for itself. python3 alone (no torch), so CI tests it (tests/test_perf_compare.py).

  python3 bench/perf_compare.py NEW.json [--results bench/results | --baseline OLD.json]
                                [--threshold 0.05] [--json REPORT.json]
Exit status: 0 no figure dropped, 1 a figure dropped by more than the threshold (or is missing
or failed in NEW while the baseline has it), 2 bad input (unreadable file, another model shape).
No earlier result is not a failure: the report says so and the status is 0.

Figures and the ceiling each one is judged against:
  decode_ms      batch-1 decode 128 + 256, ms per output token (lower is better): copy
                 bandwidth, since a decode step streams the weights once.
  prefill512_ms  one 512-token prompt, ms to the first token (lower is better): bf16 matrix rate.
  offline_tok_s  offline 1,000 x (512 + 256), output tokens/s (higher is better): bf16 matrix
                 rate. Its steps batch 256 decode rows plus prefill chunks, so each weight is
                 used by >= 256 rows per read: 2 * 256 flops per 2 bytes, above the H200's
                 ridge point (~750 TFLOP/s / ~4 TB/s ~= 190 flops per byte); its GEMMs are
                 compute-bound and the matrix rate is the nearer ceiling.

For each figure, "speed" is the ratio new/old turned so that above 1 means faster, and
"normalised" is speed * (old ceiling / new ceiling): the speed-up beyond what the card's own
ceiling moved. A figure has dropped when BOTH fall below 1 - threshold. Requiring both keeps a
drop that the ceiling explains (a slower card: speed down, normalised even) from being flagged,
and equally the noise of the ceiling measurement itself: the H200s here measured 3,811 and
4,252 GB/s in two runs with decode at 5.07 ms in both (issue 24), a 10% swing that normalised
alone would call a decode regression.
"""
import argparse
import glob
import json
import os
import sys

# name -> (lower_is_better, ceiling key, label)
FIGURES = {
    "decode_ms": (True, "copy_GBps", "batch-1 decode 128+256 (ms/token)"),
    "prefill512_ms": (True, "bf16_TFLOPs", "prefill 512 (ms)"),
    "offline_tok_s": (False, "bf16_TFLOPs", "offline 1000 x (512+256) (tok/s)"),
}


class BadInput(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput("%s: cannot read a result: %s" % (path, e))
    if not isinstance(r, dict) or not isinstance(r.get("figures"), dict) or not r.get("date"):
        raise BadInput("%s: not a perf result (wants 'date' and a 'figures' object)" % path)
    return r


def value(result, name):
    """The figure's number, or None when absent, failed or not a positive number."""
    f = result.get("figures", {}).get(name)
    if isinstance(f, dict):
        f = f.get("value")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
        return None
    return float(f)


def ceiling(result, key):
    c = result.get("ceilings", {}).get(key)
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
        return None
    return float(c)


def gpu_of(result):
    return (result.get("machine") or {}).get("gpu")


def newest_earlier(results_dir, new, new_path=None):
    """The newest result in results_dir dated before `new` (by its 'date' field), skipping
    new_path itself and files of another shape, preferring the newest on the same card
    (machine.gpu: an H100 run is compared with the last H100 run, not with a newer H200 one,
    whose ceilings differ by more than the threshold); a result on another card only when the
    directory has none on this one. None when there is none at all."""
    best = {True: None, False: None}  # same card?
    for p in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        if new_path and os.path.abspath(p) == os.path.abspath(new_path):
            continue
        try:
            r = load(p)
        except BadInput:
            continue  # not a result file; the check does not stop for it
        if r.get("shape") != new.get("shape") or not r["date"] < new["date"]:
            continue
        same = gpu_of(r) == gpu_of(new)
        if best[same] is None or r["date"] > best[same][1]["date"]:
            best[same] = (p, r)
    return best[True] or best[False]


def compare(new, old, threshold=0.05):
    """A report: {"rows": [...], "regressed": [...names], "notes": [...]}. Raises BadInput when
    the two results are of different model shapes."""
    if new.get("shape") != old.get("shape"):
        raise BadInput("the results are of different shapes: %r and %r" %
                       (new.get("shape"), old.get("shape")))
    if not 0 < threshold < 1:
        raise BadInput("threshold %r is not between 0 and 1" % threshold)
    rows, regressed, notes = [], [], []
    gn, go = new.get("machine", {}).get("gpu"), old.get("machine", {}).get("gpu")
    if gn and go and gn != go:
        notes.append("different GPUs: %s now, %s before" % (gn, go))
    for name, (lower, ckey, label) in FIGURES.items():
        vn, vo = value(new, name), value(old, name)
        row = {"figure": name, "label": label, "new": vn, "old": vo, "ceiling": ckey}
        if vo is None:
            row["verdict"] = "no baseline" if vn is not None else "absent"
            rows.append(row)
            continue
        if vn is None:
            row["verdict"] = "MISSING"
            regressed.append(name)
            rows.append(row)
            continue
        speed = vo / vn if lower else vn / vo
        cn, co = ceiling(new, ckey), ceiling(old, ckey)
        norm = speed * co / cn if cn and co else None
        row.update(speed=speed, ceiling_new=cn, ceiling_old=co, normalised=norm)
        if norm is None:
            notes.append("%s: no %s in one of the runs; judged by speed alone" % (name, ckey))
        worst_kept = max(speed, norm) if norm is not None else speed
        if worst_kept < 1 - threshold:
            row["verdict"] = "DROP"
            regressed.append(name)
        else:
            row["verdict"] = "ok"
        rows.append(row)
    return {"rows": rows, "regressed": regressed, "notes": notes, "threshold": threshold}


def render(report, new, old, old_path=None):
    out = ["now:    %s  %s  %s" % (new.get("commit", "?"), new["date"], new.get("machine", {}).get("gpu", "")),
           "before: %s  %s  %s%s" % (old.get("commit", "?"), old["date"], old.get("machine", {}).get("gpu", ""),
                                      "  (%s)" % os.path.basename(old_path) if old_path else "")]
    if old.get("source"):
        out.append("        before: %s" % old["source"])
    for k in ("copy_GBps", "bf16_TFLOPs"):
        out.append("ceiling %-12s now %-9s before %s" % (k, ceiling(new, k), ceiling(old, k)))
    out.append("%-36s %10s %10s %7s %7s %8s" % ("figure", "before", "now", "speed", "ceil", "verdict"))

    def f(v, nd=3):
        return "-" if v is None else "%.*f" % (nd, v)

    for r in report["rows"]:
        out.append("%-36s %10s %10s %7s %7s %8s" % (
            r["label"], f(r["old"], 2), f(r["new"], 2), f(r.get("speed")), f(r.get("normalised")),
            r["verdict"]))
    out.append("speed: above 1 = faster now; ceil: speed against the runs' own ceilings; a DROP "
               "is both below %.2f" % (1 - report["threshold"]))
    out += ["note: " + n for n in report["notes"]]
    out.append("REGRESSION: " + ", ".join(report["regressed"]) if report["regressed"]
               else "no figure dropped by more than %.0f%%" % (100 * report["threshold"]))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("new")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    g.add_argument("--baseline")
    ap.add_argument("--threshold", type=float, default=0.05)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        new = load(a.new)
        if a.baseline:
            old_path, old = a.baseline, load(a.baseline)
        else:
            found = newest_earlier(a.results, new, a.new)
            if not found:
                print("no earlier result of shape %r in %s: nothing to compare with" %
                      (new.get("shape"), a.results))
                return 0
            old_path, old = found
        report = compare(new, old, a.threshold)
    except BadInput as e:
        print("perf_compare: %s" % e, file=sys.stderr)
        return 2
    report["baseline"] = old_path
    print(render(report, new, old, old_path))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["regressed"] else 0


if __name__ == "__main__":
    sys.exit(main())
