"""What distsync's launching process does before and after a job, profiled: a cProfile of
``distsync.cli.main(["train", ...])`` with ``launch`` patched to return a given summary at once.

    python benchmarks/startup_profile/profile_main.py SUMMARY.json WORKERS OUT_DIR

Prints one JSON line: the seconds to import distsync.cli, main's seconds before and after
the (patched) launch, and the 25 functions of largest cumulative time
(``benchmarks/startup.py --breakdown`` runs it).
"""

import cProfile, json, pstats, sys, time
t0 = time.perf_counter()
import distsync.cli as cli
t1 = time.perf_counter()
import distsync.runtime
import distsync.runtime.launch  # noqa: F401  (patched below through sys.modules)
summary = json.loads(open(sys.argv[1]).read())
marks = {}
def fake_launch(*args, **kwargs):
    marks["launch"] = time.perf_counter()
    return summary
# the package's attribute `launch` is the function (it shadows the module's name)
sys.modules["distsync.runtime"].launch = sys.modules["distsync.runtime.launch"].launch = fake_launch
prof = cProfile.Profile()
t2 = time.perf_counter()
prof.enable()
cli.main(["train", "--overwrite", "--workload", "digits", "--steps", "1", "--workers", sys.argv[2], "--out", sys.argv[3]])
prof.disable()
t3 = time.perf_counter()
st = pstats.Stats(prof)
rows = []
for (fn, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
    rows.append({"function": f"{fn.split('site-packages/')[-1].split('/src/')[-1]}:{line}({name})", "cum_s": ct,
                 "calls": nc})
rows.sort(key=lambda r: -r["cum_s"])
keep = [r for r in rows if not r["function"].startswith(("<frozen", "{built-in"))
        and "importlib" not in r["function"]][:25]
print(json.dumps({"import_cli_s": t1 - t0, "main_s": t3 - t2, "main_before_launch_s": marks["launch"] - t2,
                  "main_after_launch_s": t3 - marks["launch"], "top_cumulative": keep}))
