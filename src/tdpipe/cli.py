"""`tdpipe` command line: generate, chat, bench, plot, predictor, simulate, serve, run-batch, smoothquant."""
from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C while Python imports torch (a second or two): one line, not a traceback from inside an import."""
    print("tdpipe: interrupted", file=sys.stderr)
    os._exit(130)


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "tdpipe":  # the command, not an import
    signal.signal(signal.SIGINT, _interrupted_while_starting)  # main() puts the normal handler back

import argparse  # noqa: E402
import json  # noqa: E402

from tdpipe.engine_args import EngineArgs
from tdpipe.entrypoints.args import add_sampling_args, sampling_kwargs
from tdpipe.entrypoints.conversation import check_conversation
from tdpipe.entrypoints.preflight import PreflightError, check_model, check_readable, check_writable
from tdpipe.entrypoints.results import ResultSink
from tdpipe.tokenizer import chat_prompt
from tdpipe.version import package_version


def _read_prompts(a: argparse.Namespace) -> list[dict]:
    """Prompts from arguments, --input (text: one per line; .jsonl: {"prompt": ...}, {"prompt_token_ids": ...} or
    {"messages": [{"role", "content"}, ...]}, a conversation for the chat template), or stdin.

    A line that is not UTF-8, or a JSONL line that is not valid or whose fields have the wrong type, becomes
    {"error": "line N: ..."}: that request fails alone and the others run."""
    if a.prompts:
        return [{"prompt": p} for p in a.prompts]
    lines = _input_lines(a.input)
    jsonl = (a.input or "").endswith(".jsonl") or bool(
        lines and isinstance(lines[0], str) and lines[0].lstrip().startswith("{"))
    out = []
    for i, ln in enumerate(lines):
        if isinstance(ln, UnicodeDecodeError):
            out.append({"error": f"line {i + 1}: not valid UTF-8 (byte {ln.start})"})
        elif ln.strip():
            out.append(_parse_record(ln, i + 1) if jsonl else {"prompt": ln})
    return out


def _input_lines(path: str | None) -> list[str | UnicodeDecodeError]:
    """The lines of --input (or stdin), each decoded on its own: one that is not UTF-8 is its error, so the
    others still run (decoding the whole file at once failed it all, naming no line)."""
    f = open(path, "rb") if path and path != "-" else getattr(sys.stdin, "buffer", sys.stdin)
    with f:
        raw = f.read()
    if isinstance(raw, str):  # a text stream without a buffer (a test's StringIO)
        return raw.splitlines()
    out: list[str | UnicodeDecodeError] = []
    for ln in raw.splitlines():
        try:
            out.append(ln.decode("utf-8"))
        except UnicodeDecodeError as e:
            out.append(e)
    return out


def _parse_record(ln: str, lineno: int) -> dict:
    try:
        rec = json.loads(ln)
    except json.JSONDecodeError as e:
        return {"error": f"line {lineno}: not valid JSON: {e}"}
    if not isinstance(rec, dict):
        return {"error": f"line {lineno}: expected a JSON object, got {type(rec).__name__}"}
    err = None
    if not any(k in rec for k in ("prompt", "prompt_token_ids", "messages")):
        err = "a JSONL record needs a 'prompt', 'prompt_token_ids' or 'messages' field"
    elif "prompt" in rec and not isinstance(rec["prompt"], str):
        err = f"'prompt' must be a string, got {type(rec['prompt']).__name__}"
    elif "prompt_token_ids" in rec and not (isinstance(rec["prompt_token_ids"], list) and all(
            type(t) is int for t in rec["prompt_token_ids"])):
        err = "'prompt_token_ids' must be a list of integers"
    elif "messages" in rec:
        try:
            check_conversation(rec["messages"])
        except ValueError as e:
            err = f"'messages': {e}"
    if err:
        return {"error": f"line {lineno}: {err}", "prompt": rec.get("prompt") if isinstance(
            rec.get("prompt"), str) else None}
    return rec | {"line": lineno}


def _check_generate_paths(a: argparse.Namespace) -> None:
    """Every file the run reads or writes, checked before the model loads (a missing directory for -o must
    not cost a run)."""
    check_readable(a.input, "--input")
    check_writable(a.output, "--output")
    check_writable(a.trace, "--trace")
    check_writable(a.record_history, "--record-history")
    if a.resume and not a.output:
        raise PreflightError("--resume needs --output FILE: it skips the prompts already answered there")


def cmd_generate(a: argparse.Namespace) -> int:
    from tdpipe.entrypoints.llm import LLM
    from tdpipe.sampling.params import SamplingParams

    _check_generate_paths(a)
    recs = _read_prompts(a)
    if not recs:
        raise SystemExit("no prompts: give them as arguments, with --input FILE, or on stdin")
    sp = SamplingParams(**sampling_kwargs(a))  # validate flags before loading the model
    sink = ResultSink(a.output, ordered=a.ordered, resume=a.resume)
    sink.check_resumed(recs)
    todo = [i for i in range(len(recs)) if i not in sink.done]
    with sink:
        for i in todo:  # lines that failed to parse are answered (with their error) before any model loads
            if "error" in recs[i]:
                sink.write(i, _error_record(i, recs[i], recs[i]["error"]))
        todo = [i for i in todo if "error" not in recs[i]]
        if not todo:
            return sink.finish(len(recs))
        llm = None
        try:
            llm = LLM(**_engine_kwargs(a))
            prompts, errors = _to_prompts(llm.get_tokenizer(), recs, todo, a.chat_template)
            for i, err in errors.items():
                sink.write(i, _error_record(i, recs[i], err))
            todo = [i for i in todo if i not in errors]
            for k, o in llm.generate_unordered([prompts[i] for i in todo], sp, use_tqdm=not a.no_progress):
                i = todo[k]
                sink.write(i, _output_record(i, recs[i], o, a.output_token_ids))
        except KeyboardInterrupt:
            return sink.stopped(len(recs), "interrupted", 130)
        except OSError as e:
            if not sink.write_failed:
                raise
            return sink.stopped(len(recs), f"writing {a.output} failed ({e.strerror or e})", 1)
        except RuntimeError as e:  # PipelineError (a stage died) among them
            _failed_pipeline(e)
            return sink.stopped(len(recs), f"the run failed: {e}", 1)
        finally:
            if llm is not None:
                llm.shutdown()
        return sink.finish(len(recs))


def _engine_kwargs(a: argparse.Namespace) -> dict:
    """The LLM's keywords from the flags, after forking the stages it will start while this process is still
    blank (pipeline/prefork.py: torch imported, nothing computed, one thread)."""
    from tdpipe.pipeline import prefork

    args = EngineArgs.from_cli(a)
    prefork.reserve(prefork.stages_for(args.create_engine_config().parallel))
    return args.to_kwargs()


def _to_prompts(tok, recs: list[dict], todo: list[int], chat_template: bool) -> tuple[dict[int, object],
                                                                                     dict[int, str]]:
    """Each record as a prompt for LLM.generate, and the errors of conversations the template rejects."""
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    for i in todo:
        r = recs[i]
        if "prompt_token_ids" in r:
            out[i] = {"prompt": r.get("prompt"), "prompt_token_ids": r["prompt_token_ids"]}
            continue
        conv = r.get("messages") or ([{"role": "user", "content": r["prompt"]}] if chat_template else None)
        if conv is None:
            out[i] = r["prompt"]
            continue
        if "messages" in r:  # its text (for the history, the predictor) is the turns' contents
            r.setdefault("prompt", "\n".join(m["content"] for m in conv))
        try:
            out[i] = {"prompt": r["prompt"], "prompt_token_ids": chat_prompt(tok, conv)[1]}
        except Exception as e:  # noqa: BLE001 - the template's own errors
            errors[i] = f"line {r.get('line', i + 1)}: chat template: {e}"
    return out, errors


def _output_record(i: int, r: dict, o, with_ids: bool) -> dict:
    """One JSON line: the first answer's text at the top level; with n > 1 every answer under "samples";
    logprobs as [{token id: {"logprob", "rank", "token"}}] per position."""
    c = o.outputs[0]
    rec = {"index": i, "request_id": o.request_id, "prompt": o.prompt if o.prompt is not None else r.get("prompt"),
           "text": c.text, "finish_reason": c.finish_reason, "num_prompt_tokens": len(o.prompt_token_ids),
           "num_output_tokens": sum(len(x.token_ids) for x in o.outputs)}
    if o.error:
        rec["error"] = (f"line {r['line']}: " if "line" in r else "") + o.error
    if with_ids:
        rec["token_ids"] = c.token_ids
    if c.logprobs is not None:
        rec["logprobs"], rec["cumulative_logprob"] = _logprobs_json(c.logprobs), c.cumulative_logprob
    if o.prompt_logprobs is not None:
        rec["prompt_logprobs"] = _logprobs_json(o.prompt_logprobs)
    if len(o.outputs) > 1:
        rec["samples"] = []
        for x in o.outputs:
            s = {"index": x.index, "text": x.text, "finish_reason": x.finish_reason,
                 "cumulative_logprob": x.cumulative_logprob}
            if with_ids:
                s["token_ids"] = x.token_ids
            if x.logprobs is not None:
                s["logprobs"] = _logprobs_json(x.logprobs)
            rec["samples"].append(s)
    return rec


def _logprobs_json(positions: list) -> list:
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                                    for t, lp in p.items()} for p in positions]


def _error_record(i: int, r: dict, error: str) -> dict:
    return {"index": i, "request_id": None, "prompt": r.get("prompt"), "text": "", "finish_reason": "error",
            "num_prompt_tokens": 0, "num_output_tokens": 0, "error": error}


def cmd_chat(a: argparse.Namespace) -> int:
    from tdpipe.entrypoints.llm import LLM
    from tdpipe.sampling.params import SamplingParams

    sp = SamplingParams(**sampling_kwargs(a))
    llm = LLM(**_engine_kwargs(a))
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("tdpipe chat: type a message; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = llm.chat(history, sp, use_tqdm=False)[0]
        reply = out.outputs[0].text if not out.error else f"[error: {out.error}]"
        print(reply, flush=True)
        history.append({"role": "assistant", "content": reply})


def cmd_plot_timeline(a: argparse.Namespace) -> int:
    from tdpipe.viz import timeline as tl

    try:
        trace = tl.load_trace(a.file)
        summ = tl.summarize(trace)
        out = tl.plot_timeline(trace, a.output, title=a.title)
    except FileNotFoundError:
        raise SystemExit(f"tdpipe: error: no such trace file: {a.file}")
    except (ValueError, OSError) as e:
        raise SystemExit("tdpipe: error: " + " ".join(str(e).split()))
    dec = summ["decode_bubble_ratio_per_stage"]
    rows = [("stage", "micro-batches", "busy s", "bubble", "decode bubble")]
    for i, st in enumerate(trace["stages"]):
        rows.append((tl.stage_label(st, i), str(summ["num_micro_batches"][i]), f"{summ['busy_s'][i]:.3f}",
                     f"{summ['bubble_ratio_per_stage'][i]:.3f}", "-" if dec is None else f"{dec[i]:.3f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(x.ljust(w) if c == 0 else x.rjust(w) for c, (x, w) in enumerate(zip(r, widths))))
    mean_dec = summ["decode_bubble_ratio"]
    print(f"wall {summ['wall_s']:.3f} s; mean bubble ratio {summ['bubble_ratio']:.3f}; mean decode bubble ratio "
          + ("-" if mean_dec is None else f"{mean_dec:.3f}"))
    print(f"wrote {out}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    """`tdpipe serve`: both configs checked before the port is taken; the server (FastAPI) imported only now."""
    from tdpipe.entrypoints.openai.api_server import run_server
    from tdpipe.entrypoints.openai.serve_args import engine_config, server_config

    ecfg = engine_config(a)  # takes the positional MODEL as --model
    check_model(a.model)  # a missing model: one line now, not a core that fails after the port is taken
    return run_server(server_config(a), ecfg)


class _VersionAction(argparse.Action):
    """--version: prints "tdpipe X" and exits. The version is read when asked (tdpipe/version.py), not each
    time the parser is built."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **_: object) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"tdpipe {package_version()}")
        parser.exit()


def build_parser(command: str | None = "") -> argparse.ArgumentParser:
    """The whole parser; `command` (the one a command line names, None for none) leaves out the bench
    subcommands unless it is "bench": their modules import torch, a second of start-up that `tdpipe serve`,
    `run-batch` or `--help` do not need."""
    p = argparse.ArgumentParser(prog="tdpipe", description="Throughput-first LLM inference: paged KV, continuous "
                                "batching, pipeline parallelism (TD-Pipe, gLLM, SiPipe).")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate for a batch of prompts; JSONL out",
                       description="Generate for prompts given as arguments, in a text file (one per line) or "
                                   "JSONL file ({'prompt': ...}, {'prompt_token_ids': [...]} or {'messages': "
                                   "[{'role': ..., 'content': ...}, ...]} per line), or on stdin. Writes one JSON "
                                   "object per prompt as it finishes ('index' = its input position; --ordered "
                                   "for input order). Exit code 0 when every request succeeded, 1 when any "
                                   "failed (its record has 'error'), 130 when interrupted; --resume finishes "
                                   "an interrupted run.")
    g.add_argument("prompts", nargs="*", help="prompts (if none: --input or stdin)")
    g.add_argument("--input", "-i", default=None, help="text or .jsonl file of prompts ('-' = stdin)")
    g.add_argument("--output", "-o", default=None,
                   help="JSONL output file (default stdout); each answer is written and flushed as it finishes, "
                        "so an interrupted or failed run keeps every finished answer")
    g.add_argument("--ordered", action="store_true",
                   help="write answers in input order (holding back only those that finish before an earlier "
                        "one); default: as they finish. Every record has 'index', its prompt's position")
    g.add_argument("--resume", action="store_true",
                   help="skip the prompts already answered in --output (same input) and append the rest")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user turn of the chat template")
    g.add_argument("--output-token-ids", action="store_true", help="include output token ids in the JSONL")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(g)
    add_sampling_args(g)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    EngineArgs.add_cli_args(c)
    add_sampling_args(c, max_tokens=512, samples=False)
    c.set_defaults(fn=cmd_chat)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    if command in ("", "bench"):
        for name in ("throughput", "serve", "prefix", "layouts", "sampler", "llama_cpp", "gemm", "perplexity"):
            __import__(f"tdpipe.bench.{name}", fromlist=["add_parser"]).add_parser(bsub)

    pl = sub.add_parser("plot", help="pictures of pipeline traces",
                        description="Pictures of pipeline-parallel traces: 'timeline' draws the per-stage "
                                    "Gantt chart (TD-Pipe Fig. 2) over KV cache usage (TD-Pipe Fig. 12) and "
                                    "prints each stage's bubble ratio (idle / wall time per stage).")
    plsub = pl.add_subparsers(dest="plot", required=True)
    t = plsub.add_parser(
        "timeline", help="per-stage timeline and KV usage of a pipeline trace (PNG) plus bubble ratios",
        description="Draw a tdpipe-trace/1 JSON trace as a per-stage Gantt chart (TD-Pipe Fig. 2: compute "
                    "coloured prefill / decode / mixed, input waits as thin grey bars) over the KV cache usage "
                    "fraction in time (TD-Pipe Fig. 12), and print per stage: micro-batches, busy seconds, "
                    "bubble ratio and decode bubble ratio. Bubble ratio = idle / wall time of a stage, wall "
                    "being [first event start, last event end] over all stages and busy the union of the "
                    "stage's compute intervals; the decode bubble ratio uses the window after the last "
                    "prefill ends.")
    t.add_argument("file", help="trace JSON file written by the pipeline runtime")
    t.add_argument("--output", "-o", default="timeline.png", help="PNG to write (default timeline.png)")
    t.add_argument("--title", default=None, help="title of the picture")
    t.set_defaults(fn=cmd_plot_timeline)
    __import__("tdpipe.entrypoints.plot_latency", fromlist=["add_parser"]).add_parser(plsub)

    from tdpipe.predictor import cli as predictor_cli

    predictor_cli.add_parser(sub)

    from tdpipe.sim import cli as sim_cli

    sim_cli.add_parser(sub)
    __import__("tdpipe.entrypoints.openai.serve_args", fromlist=["add_parser"]).add_parser(sub).set_defaults(
        fn=cmd_serve)
    __import__("tdpipe.entrypoints.run_batch", fromlist=["add_parser"]).add_parser(sub)
    __import__("tdpipe.entrypoints.smoothquant", fromlist=["add_parser"]).add_parser(sub)
    gpu_check = __import__("tdpipe.bench.gpu_check", fromlist=["add_parser"]).add_parser(sub)
    __import__("tdpipe.sim.gpu_cli", fromlist=["add_parser"]).add_parser(gpu_check)
    return p


_PIPELINE_FAILED = False


def _failed_pipeline(e: BaseException) -> None:
    global _PIPELINE_FAILED
    from tdpipe.pipeline.executor import PipelineError

    _PIPELINE_FAILED = _PIPELINE_FAILED or isinstance(e, PipelineError)


def run() -> None:
    """The `tdpipe` command. After a pipeline failure (a stage died) or a Ctrl-C everything is reported and
    written by the time main() returns; the process then ends with os._exit, skipping interpreter teardown:
    there torch.distributed's objects with a dead peer have been seen to abort the process (exit -6 instead of
    1), and teardown puts SIGINT's default action back, so a Ctrl-C landing in it (a second press) ended the
    process by the signal (exit -2) instead of 130 (seen once in the fault tests)."""
    code = main()
    if code == 130:  # a Ctrl-C: the exit functions (the pipelines' shutdown) run here, SIGINT still handled
        import atexit

        atexit._run_exitfuncs()
    if _PIPELINE_FAILED or code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from tdpipe.frozen_heap import freeze_heap

    freeze_heap()  # before the interpreter's teardown
    sys.exit(code)


def _command(argv: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option (`tdpipe` itself has none
    that take a value)."""
    return next((w for w in argv if not w.startswith("-")), None)


def _imports_torch(args: argparse.Namespace) -> bool:
    """Whether the command's work imports torch in this process: all but the plots and the simulator, and
    serve and run-batch, whose engines run in engine-core processes while this one serves HTTP and tokenizes
    (1.3-3 s of CPU at start-up that none of them needs; a request for structured output imports xgrammar,
    and with it torch, on a worker thread). main() imports it before the KeyboardInterrupt handler goes in,
    because torch's import runs Python beneath C++ (pybind11: torch.distributed's `_c10d_init`), where a
    KeyboardInterrupt cannot cross and the process aborts (a fault test saw exit -6 for a Ctrl-C a second
    into `tdpipe generate`)."""
    return (args.command not in ("plot", "simulate", "serve", "run-batch")
            and not args.fn.__module__.startswith("tdpipe.sim."))


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser(_command(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    except KeyboardInterrupt:
        print("tdpipe: interrupted", file=sys.stderr)
        return 130
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        if _imports_torch(args):
            import torch  # noqa: F401 - while a Ctrl-C still ends the process at once (see _imports_torch)
        from tdpipe.interrupt import install_sticky_sigint

        install_sticky_sigint()  # from here Ctrl-C is a KeyboardInterrupt, never lost nor a stray traceback
    try:
        return args.fn(args) or 0
    except PreflightError as e:
        print(f"tdpipe: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tdpipe: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from tdpipe.pipeline.executor import PipelineError

        if not isinstance(e, PipelineError):
            raise
        _failed_pipeline(e)
        print(f"tdpipe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tdpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    run()
