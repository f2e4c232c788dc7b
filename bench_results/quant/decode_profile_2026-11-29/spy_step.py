import sys, collections, re
tot = 0; inexec = 0; step = 0
by = collections.Counter(); leaf = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); frames = stack.split(";")
    tot += n
    if not any(f.startswith("LLMEngine.step (tdpipe/core/engine.py") for f in frames): continue
    step += n
    if any("model_runner.py" in f and ".execute (" in f for f in frames): inexec += n; continue
    i = max(i for i, f in enumerate(frames) if f.startswith("LLMEngine.step (tdpipe/core/engine.py"))
    key = ";".join(re.sub(r" \(.*?/?([^/]+\.py):\d+\)", r"@\1", f) for f in frames[i+1:i+4])
    by[key] += n
    leaf[re.sub(r":\d+\)", ")", frames[-1])] += n
print("total", tot, "in step", step, "in execute", inexec, "step-other", step - inexec)
for k, v in by.most_common(25): print(f"{v:6d} {k}")
print("--- leaves")
for k, v in leaf.most_common(25): print(f"{v:6d} {k}")
