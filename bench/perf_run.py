"""perf_run.py - the measurements shared by bench/perf_check.py and bench/perf_bisect.py: the
figures of issue 24 taken with `kiln bench` on a Kiln build, and a description of the machine.
No torch here (the model and the ceilings come from bench/cuda_7b.py); python3 alone.

Figures (each a dict from the bench's --json, plus "cmd", "wall_s"; or {"error": ...}):
  decode      kiln bench latency, batch 1, 128 + 256, 5 iterations after 1 warm-up: tpot_ms p50
  prefill     kiln bench latency, batch 1, 512 + 1, 10 iterations after 2 warm-ups: ttft_ms p50
  throughput  kiln bench throughput, N x (512 + 256) (N = 1000 for the check's figure)
"""
import ctypes
import json
import os
import re
import shutil
import subprocess
import time


def log(*a):
    print(*a, flush=True)


def kiln_bench(kiln_bin, args, model, tag, cwd=None, env=None, timeout=400):
    """Runs `kiln bench ARGS --model MODEL --json F --set backend.name=cuda` in cwd (whose
    etc/kiln.ini the run reads), returns the parsed JSON with "cmd" and "wall_s" added, or
    {"error": ..., "cmd": ...}."""
    out = "/tmp/kiln_perf_%s_%d.json" % (re.sub(r"[^A-Za-z0-9_.-]", "_", tag), os.getpid())
    if os.path.exists(out):
        os.remove(out)
    cmd = [kiln_bin, "bench"] + list(args) + ["--model", model, "--json", out,
                                              "--set", "backend.name=cuda"]
    full_env = dict(os.environ)
    full_env.update(env or {})
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=full_env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %d s" % timeout, "cmd": " ".join(cmd)}
    res = {"cmd": " ".join(cmd[1:]), "wall_s": round(time.time() - t0, 1)}
    if env:
        res["env"] = dict(env)
    if r.returncode != 0 or not os.path.exists(out):
        res["error"] = (r.stderr or r.stdout)[-1500:]
        log(tag, "FAILED:", res["error"])
        return res
    with open(out) as f:
        res.update(json.load(f))
    os.remove(out)
    return res


def decode(kiln_bin, model, tag="decode", **kw):
    return kiln_bench(kiln_bin, ["latency", "--batch-size", "1", "--input-len", "128",
                                 "--output-len", "256", "--num-iters", "5", "--warmup", "1"],
                      model, tag, **kw)


def prefill(kiln_bin, model, tag="prefill", **kw):
    return kiln_bench(kiln_bin, ["latency", "--batch-size", "1", "--input-len", "512",
                                 "--output-len", "1", "--num-iters", "10", "--warmup", "2"],
                      model, tag, **kw)


def throughput(kiln_bin, model, n, tag="throughput", **kw):
    return kiln_bench(kiln_bin, ["throughput", "--num-prompts", str(n), "--input-len", "512",
                                 "--output-len", "256"], model, tag, **kw)


def figure(res, kind):
    """The headline number of a figure's result, or None: decode ms/token (tpot p50), prefill
    ms (ttft p50), throughput output tokens/s."""
    if not res or "error" in res:
        return None
    try:
        if kind == "decode":
            return float(res["tpot_ms"]["p50"])
        if kind == "prefill":
            return float(res["ttft_ms"]["p50"])
        if kind == "throughput":
            return float(res["output_tokens_per_s"])
    except (KeyError, TypeError, ValueError):
        return None
    raise ValueError("unknown figure kind %r" % kind)


def _run(cmd, cwd=None):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=60)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return "(%s: %s)" % (cmd[0], e)


def cublaslt_of(plugin):
    """The cuBLASLt the plugin loads (ldd): its version as the library itself reports it
    (cublasLtGetVersion, e.g. 130100 -> '13.1.0') and its file, or None."""
    for line in _run(["ldd", plugin]).splitlines():
        if "libcublasLt" in line and "=>" in line:
            path = line.split("=>")[1].split("(")[0].strip()
            if not path or path == "not found":
                return line.strip()
            ver = "?"
            try:
                lib = ctypes.CDLL(path)
                lib.cublasLtGetVersion.restype = ctypes.c_size_t
                v = int(lib.cublasLtGetVersion())
                ver = "%d.%d.%d" % (v // 10000, v // 100 % 100, v % 100)
            except (OSError, AttributeError) as e:
                ver = "? (%s)" % e
            return "%s (%s)" % (ver, os.path.realpath(path))
    return None


def machine(kiln_bin=None, plugin=None, cwd=None):
    """GPU, driver, toolkit and cuBLASLt versions, and Kiln's own build line."""
    m = {}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader"])
    first = smi.splitlines()[0] if smi else ""
    parts = [p.strip() for p in first.split(",")]
    if len(parts) >= 2 and not first.startswith("("):
        m["gpu"], m["driver"] = parts[0], parts[1]
    else:
        m["gpu_query"] = smi[:300]
    if shutil.which("nvcc"):
        v = re.search(r"release ([0-9.]+)", _run(["nvcc", "--version"]))
        m["nvcc"] = v.group(1) if v else None
    if plugin:
        m["cublaslt"] = cublaslt_of(plugin)
    if kiln_bin:
        info = _run([kiln_bin, "info"], cwd=cwd)
        m["kiln_info"] = "\n".join(l for l in info.splitlines()
                                   if re.search(r"cuda|CUDA|cuBLAS|gemm|archs|GPU|NVIDIA", l))[:2000]
    return m
