"""Grammar-constrained sampling with xgrammar (the backend vLLM and SGLang default to).

One `GrammarManager` per engine. A request's constraint (sampling/structured.py) is compiled for the engine's
tokenizer when the request is added, on a worker thread, so the compilation overlaps the prompt's prefill;
xgrammar caches compiled grammars, so a schema shared by many requests is compiled once. Each sequence gets
a matcher (a pushdown automaton over tokens). Before a batch is sampled, the matchers of its constrained rows
fill one token bitmask for the batch (a bit per vocabulary entry, 32 per int32), which the sampler applies
(sampling/token_masks.py); the sampled tokens reach a matcher the next time its sequence is sampled,
replayed from the sequence's outputs: so forks (n > 1) and recomputed (preempted) sequences need no
bookkeeping beyond a matcher per sequence object.
"""
from __future__ import annotations

import logging
import re
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tdpipe.sampling.structured import StructuredOutputsParams

if TYPE_CHECKING:  # no torch at import: the OpenAI frontend parses schemas (parse_grammar) without it
    import torch

log = logging.getLogger("tdpipe")

# what each kind is, for the message when xgrammar refuses it
_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "JSON object constraint"}
# Most whitespace characters a JSON schema's grammar allows between two tokens of the JSON (xgrammar's
# max_whitespace_cnt): room for indented output, but a small model sampled at temperature 1 cannot spend its
# max_tokens on blank space between two elements (it did, unbounded, in about one answer in ten)
MAX_JSON_WHITESPACE = 32
# Threads that fill a batch's bitmask (about 10 us a row on one): at pp = 1 the sampler runs between the
# model's steps, so both cores of this machine are free then
FILL_THREADS = 2
# xgrammar's C++ errors start "[09:06:00] /project/cpp/regex_converter.cc:83: " (and "Check failed: ... is false:")
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _message(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    text = _CPP_PREFIX.sub("", lines[0]) if lines else type(e).__name__
    return text[:300]


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """How a JSON schema becomes a grammar, the same for the frontend's parse and the engine's compile."""
    return {"any_whitespace": not params.disable_any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def parse_grammar(params: StructuredOutputsParams) -> None:
    """Build the constraint's grammar without a tokenizer (about a millisecond for a JSON schema): a
    ValueError naming the kind and xgrammar's reason when it is not valid."""
    import xgrammar as xgr

    how, text = params.grammar_source()
    try:
        if how == "json":
            xgr.Grammar.from_json_schema(text, **_json_options(params))
        elif how == "regex":
            xgr.Grammar.from_regex(text)
        elif how == "grammar":
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{params.kind} is not a valid {_WHAT[params.kind]}: "
                         f"{_message(e)}") from None


class _Follower:
    """A sequence's matcher and how many of its output tokens it has accepted."""

    __slots__ = ("matcher", "accepted", "broken")

    def __init__(self, matcher: Any) -> None:
        self.matcher, self.accepted, self.broken = matcher, 0, False


class GrammarManager:
    """Compiles constraints for one tokenizer and keeps a matcher per constrained sequence (weakly: a
    finished sequence's matcher goes with it). Built cheaply; xgrammar's tokenizer tables (0.1 s for a
    49k vocabulary) are built on the worker thread at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | set[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, int(vocab_size), sorted(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: a batch's rows filled by FILL_THREADS threads
        self._followers: weakref.WeakKeyDictionary[Any, _Follower] = weakref.WeakKeyDictionary()

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar, as a future: the worker thread compiles while the engine goes on."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this engine has none (simulated "
                             "or in-memory model)")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tdpipe-grammar")
        return self._pool.submit(self._compile, params)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        how, text = params.grammar_source()
        c = self._compiler
        if how == "json":
            return c.compile_json_schema(text, **_json_options(params))
        if how == "regex":
            return c.compile_regex(text)
        return c.compile_grammar(text)

    def fill(self, samples: list[tuple[Any, int]]) -> tuple[torch.Tensor, list[int]] | None:
        """The batch's token bitmask [rows, ceil(V / 32)] and the rows it constrains (None: no row is
        constrained). A row is a (sequence, sample index) pair; a sequence with a compiled constraint
        (`seq.group.grammar`, a future) whose matcher has not finished (a stop token accepted) is constrained."""
        if self._pool is None:  # no constrained request ever: nothing to look at
            return None
        import xgrammar as xgr

        rows: list[int] = []
        matchers: list[Any] = []
        at: list[int] = []  # the row each matcher fills
        copies: list[tuple[int, int]] = []  # (row, row filled): the samples an n > 1 head draws for
        filled: dict[int, int] = {}  # id(seq) -> its row
        for i, (seq, _) in enumerate(samples):
            group = seq.group
            if group is None or group.grammar is None:
                continue
            f = self._follow(seq)
            if f is None:
                continue
            first = filled.get(id(seq))
            if first is None:
                matchers.append(f.matcher)
                at.append(i)
                filled[id(seq)] = i
            else:
                copies.append((i, first))
            rows.append(i)
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(samples), self.vocab_size)  # all ones: rows without a grammar
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, at)
        for i, first in copies:
            bitmask[i] = bitmask[first]
        return bitmask, rows

    def _follow(self, seq: Any) -> _Follower | None:
        """`seq`'s matcher with its outputs so far accepted; None once it is done (or cannot follow)."""
        f = self._followers.get(seq)
        if f is None:
            import xgrammar as xgr

            f = self._followers[seq] = _Follower(xgr.GrammarMatcher(seq.group.grammar.result()))
        out = seq.output_token_ids
        while f.accepted < len(out) and not f.broken:
            if not f.matcher.accept_token(out[f.accepted]):
                # only a token the mask did not forbid gets here: one after the grammar ended (ignore_eos)
                f.broken = True
                log.debug("request %s: token %d is outside its grammar; its later tokens are unconstrained",
                          seq.request_id, out[f.accepted])
            f.accepted += 1
        if f.broken or f.matcher.is_terminated():
            return None
        return f

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["GrammarManager", "parse_grammar"]
