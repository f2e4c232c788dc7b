import torch, time
from tdpipe.platforms.cpu import keep_freed_memory
keep_freed_memory()  # as the engine runs: freed buffers stay in the heap, no page faults per call
def bench(M,N,K,thr,reps=50):
    torch.set_num_threads(thr)
    a=torch.randint(-127,127,(M,K),dtype=torch.int8); b=torch.randint(-127,127,(K,N),dtype=torch.int8)
    bt=torch.randint(-127,127,(N,K),dtype=torch.int8).t()
    for _ in range(5): torch._int_mm(a,bt)
    t=time.perf_counter()
    for _ in range(reps): torch._int_mm(a,bt)
    dt=(time.perf_counter()-t)/reps
    return 2*M*N*K/dt/1e9
for (n,M,N,K) in [("qkv",256,960,576),("o",256,576,576),("gate_up",256,3072,576),("down",256,576,1536),("qkv",128,960,576),("down",128,576,1536)]:
    g1=max(bench(M,N,K,1) for _ in range(3)); g2=max(bench(M,N,K,2) for _ in range(3))
    print(f"{n:8s} {M}x{N}x{K}: 1 thr {g1:6.0f}  2 thr {g2:6.0f}  speedup {g2/g1:.2f}")
