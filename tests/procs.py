"""Finding tdpipe's stage worker processes through /proc (no psutil, no pgrep): for the tests that kill
engines and stages and then check that nothing is left; and two torchrun "nodes" on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time


def alive(pid: int) -> bool:
    """Running (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def stage_pids_of(parent: int, live_only: bool = True) -> list[int]:
    """Stage workers started by engine `parent` (their command line names it with --parent): spawned, or
    forked and renamed (pipeline/prefork.py: setproctitle writes the line as one string)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").split()
        except OSError:
            continue
        if b"tdpipe.pipeline.stage" in cmd and b"--parent" in cmd and \
                cmd[cmd.index(b"--parent") + 1] == str(parent).encode() and (not live_only or alive(int(d))):
            found.append(int(d))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...), from /proc/PID/task/PID/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def torchrun_two_nodes(script, cwd, nprocs: tuple[int, int] = (2, 1), timeout: float = 180) -> tuple[dict, str]:
    """Run `script` under torchrun as two loopback "nodes" with `nprocs` processes each (static rendezvous
    accepts a different --nproc-per-node per node); both must exit 0. Returns the JSON that node 0 printed
    on its one `TOKENS ` line, and node 1's stdout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)

    def node(rank: int, nproc: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", str(script)]
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    nodes = [node(0, nprocs[0]), node(1, nprocs[1])]
    outs = []
    try:
        deadline = time.time() + timeout
        for p in nodes:
            outs.append(p.communicate(timeout=max(1, deadline - time.time())))
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and its workers (own session)
                p.wait()
    (out0, err0), (out1, err1) = outs
    assert nodes[0].returncode == 0, err0[-3000:]
    assert nodes[1].returncode == 0, err1[-3000:]
    lines = [ln for ln in out0.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1, (out0, err0[-3000:])
    return json.loads(lines[0][len("TOKENS "):]), out1


def broken_model_copy(src: str, dst) -> str:
    """A copy of a sharded model folder with layer 2's tensors missing: the stage that holds layer 2 fails
    while loading (the pipeline's start-up failure tests)."""
    import shutil

    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = [k for k in index["weight_map"] if k.startswith("model.layers.2.")]
    from safetensors.torch import load_file, save_file

    for shard in {index["weight_map"][k] for k in dropped}:
        tensors = {k: v for k, v in load_file(dst / shard).items() if k not in dropped}
        save_file(tensors, dst / shard, metadata={"format": "pt"})
    for k in dropped:
        del index["weight_map"][k]
    index_path.write_text(json.dumps(index))
    return str(dst)
