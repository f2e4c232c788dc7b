import torch, time, sys
from tdpipe.platforms.cpu import keep_freed_memory
keep_freed_memory()
torch.set_num_threads(2)
N, K = int(sys.argv[1]), int(sys.argv[2])
bt = torch.randint(-127, 127, (N, K), dtype=torch.int8).t()
def t(f, reps=30):
    for _ in range(3): f()
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(reps): f()
        best = min(best, (time.perf_counter() - s) / reps)
    return best
for M in [64, 128, 192, 256, 384, 512, 1024, 2048]:
    a = torch.randint(-127, 127, (M, K), dtype=torch.int8)
    res = []
    for chunk in [M, 128, 64]:
        if chunk > M: continue
        f = (lambda: torch._int_mm(a, bt)) if chunk == M else (lambda c=chunk: [torch._int_mm(a[i:i + c], bt) for i in range(0, M, c)])
        res.append((chunk, 2 * M * N * K / t(f) / 1e9))
    print(M, " ".join(f"{c}:{g:.0f}" for c, g in res), flush=True)
