"""Finding tdpipe's stage worker processes through /proc (no psutil, no pgrep): for the tests that kill
engines and stages and then check that nothing is left."""
import os


def alive(pid: int) -> bool:
    """Running (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def stage_pids_of(parent: int, live_only: bool = True) -> list[int]:
    """Stage workers started by engine `parent` (their command line names it with --parent)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"tdpipe.worker.stage" in cmd and b"--parent" in cmd and \
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
