"""A fake engine client (core/engine_client.py's EngineClient, as AsyncLLM) for fast tests of the HTTP
layer: no model, no processes. Its tokenizer is byte-level (one token per UTF-8 byte, BOS 1, EOS 2), its
outputs are deterministic letters (seeded when temperature > 0), and it keeps the bookkeeping the server's
promises are checked against: KV blocks allocated and freed, aborted request ids, the waiting queue.
"""
from __future__ import annotations

import asyncio
import random
from typing import AsyncIterator

from tdpipe.core.engine_client import EngineDeadError
from tdpipe.core.validation import EngineRequest, RequestLimits, validate_request
from tdpipe.outputs import CompletionOutput, RequestOutput
from tdpipe.sampling.params import SamplingParams

BOS, EOS, OFFSET = 1, 2, 3


class FakeTokenizer:
    """Byte-level: token id = byte + 3. A chat template in the usual shape; it rejects a system message that
    is not first, as many real templates raise for conversations they cannot render."""

    bos_token_id = BOS
    eos_token_id = EOS
    chat_template: str | None = ""  # "": the built-in rendering below; a Jinja text (--chat-template): that

    def __len__(self) -> int:
        return 256 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return [BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in ids:
            if t >= OFFSET:
                out.append(t - OFFSET)
            elif not skip_special_tokens:
                out += {BOS: b"<s>", EOS: b"</s>"}.get(t, b"<pad>")
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            **variables: object) -> str:
        """`tools` (the template's variable): their names first; an assistant's calls as name(arguments), the
        arguments as the template sees them (an object, not JSON text). Other variables (chat_template_kwargs:
        enable_thinking...) are accepted and unused, as a template that does not read them does."""
        template = variables.pop("chat_template", None) or self.chat_template
        if template:
            import jinja2

            return jinja2.Template(template).render(messages=conversation, tools=tools,
                                                    add_generation_prompt=add_generation_prompt, **variables)
        for i, m in enumerate(conversation):
            if m["role"] == "system" and i > 0:
                raise ValueError("System message must be at the beginning.")
        text = "" if tools is None else "<|tools|>" + ",".join(t["function"]["name"] for t in tools) + "\n"
        for m in conversation:
            calls = "".join(f"{c['function']['name']}({sorted(c['function']['arguments'].items())})"
                            for c in m.get("tool_calls") or [])
            text += f"<|{m['role']}|>{m['content']}{calls}\n"
        return text + ("<|assistant|>" if add_generation_prompt else "")


class FakeAsyncLLM:
    """Outputs are letters a-z (and a space every fifth token): greedy ones depend on the prompt only,
    sampled ones on the seed (or on nothing, without a seed). A prompt containing "[eos]" ends with EOS
    after 3 tokens. `delay` seconds pass between tokens; while `gate` is set but not open, requests wait
    before their first token (a queue), counted in num_waiting."""

    def __init__(self, max_model_len: int = 128, max_num_seqs: int = 4, num_blocks: int = 64,
                 block_size: int = 16, delay: float = 0.0, model_name: str = "fake-model") -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.vocab_size = len(self.tokenizer)
        self.ready = True
        self.default_sampling: dict = {}  # a model whose generation_config.json sets no sampling defaults
        self.eos_token_ids = frozenset({EOS})
        self.dead_reason: str | None = None
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.num_blocks, self.block_size = num_blocks, block_size
        self.used_blocks: dict[str, int] = {}
        self.open: set[str] = set()
        self.waiting: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: list[tuple[list[int], SamplingParams, str]] = []  # every generate() call, in order
        self.script: str | None = None  # when set, every answer is this text, then EOS
        self.prompt_tokens = self.generation_tokens = 0
        self._dead = asyncio.Event()
        # what `tdpipe serve` reads besides the EngineClient contract (AsyncLLM has them too)
        self.log_death = True
        self.death_detail: str | None = None
        self.failed_on_death = 0

    # -- the contract ----------------------------------------------------------------------------------
    async def generate(self, prompt: EngineRequest | str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self.check_health()
        if not isinstance(prompt, EngineRequest):  # a raw prompt: the same validation AsyncLLM applies
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            prompt = validate_request(request_id, ids, params, RequestLimits.of(self))
        ids, params, request_id = prompt.prompt_token_ids, prompt.params, prompt.request_id
        if request_id in self.open:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.requests.append((ids, params, request_id))
        self.open.add(request_id)
        finished = False
        try:
            if self.gate is not None and not self.gate.is_set():
                self.waiting.add(request_id)
                try:
                    await self._wait(self.gate)
                finally:
                    self.waiting.discard(request_id)
            self.prompt_tokens += len(ids)
            rng = random.Random(params.seed) if params.seed is not None else random.Random()
            out: list[int] = []
            text = ""
            max_tokens = params.max_tokens or self.max_model_len - len(ids)
            while True:
                await self._tick()
                tok = self._next(ids, out, params, rng) if self.script is None else self._scripted(out)
                out.append(tok)
                self.generation_tokens += 1
                self.used_blocks[request_id] = -(-(len(ids) + len(out)) // self.block_size)
                reason, stop_reason = None, None
                if tok == EOS and not params.ignore_eos and len(out) > params.min_tokens:
                    reason = "stop"
                elif tok in params.stop_token_ids:
                    reason, stop_reason = "stop", tok
                text = self.tokenizer.decode(out, params.skip_special_tokens)
                for s in params.stop:
                    k = text.find(s)
                    if k >= 0:
                        text = text[:k + len(s)] if params.include_stop_str_in_output else text[:k]
                        reason, stop_reason = "stop", s
                        break
                if reason is None and (len(out) >= max_tokens or len(ids) + len(out) >= self.max_model_len):
                    reason = "length"
                finished = reason is not None
                yield RequestOutput(request_id, None, ids, [CompletionOutput(0, text, list(out), reason,
                                                                             stop_reason)], finished=finished)
                if finished:
                    self.finished.append(request_id)
                    return
        finally:
            if not finished and request_id not in self.aborted:
                self.aborted.append(request_id)
            self.open.discard(request_id)
            self.used_blocks.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        used = sum(self.used_blocks.values())
        running = len(self.open) - len(self.waiting)
        return {"num_running": running, "num_waiting": len(self.waiting), "num_requests": len(self.open),
                "kv_usage": used / self.num_blocks, "num_blocks": self.num_blocks,
                "num_free_blocks": self.num_blocks - used, "num_preemptions": 0,
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "stage_busy": [0.75, 0.5]}

    def check_health(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        self.ready = False

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return self.dead_reason or ""

    # -- test controls ---------------------------------------------------------------------------------
    def die(self, reason: str = "engine core process exited with signal 9", detail: str | None = None) -> None:
        """Every open request raises EngineDeadError at its next step, as when the core process dies.
        `detail`: what only the log may show (AsyncLLM's death_detail: the core's exception text)."""
        self.dead_reason = reason
        self.death_detail = detail or reason
        self.failed_on_death = len(self.open)
        self.ready = False  # as AsyncLLM: a dead engine is not ready
        self._dead.set()

    async def _tick(self) -> None:
        if self.delay:
            await self._wait(None, self.delay)
        else:
            await asyncio.sleep(0)
        self.check_health()

    async def _wait(self, event: asyncio.Event | None, timeout: float | None = None) -> None:
        """Wait for `event` (or `timeout` seconds), but raise EngineDeadError at once when the engine dies."""
        waits = [asyncio.ensure_future(self._dead.wait())]
        if event is not None:
            waits.append(asyncio.ensure_future(event.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.check_health()

    def _scripted(self, out: list[int]) -> int:
        ids = self.tokenizer.encode(self.script or "", add_special_tokens=False) + [EOS]
        return ids[len(out)] if len(out) < len(ids) else EOS

    @staticmethod
    def _next(prompt: list[int], out: list[int], params: SamplingParams, rng: random.Random) -> int:
        k = len(out)
        if k == 3 and bytes(t - OFFSET for t in prompt if t >= OFFSET).find(b"[eos]") >= 0:
            return EOS
        if k % 5 == 4:
            return ord(" ") + OFFSET
        if params.temperature == 0:
            letter = (sum(prompt) + 7 * k) % 26
        else:
            letter = rng.randrange(26)
        return ord("a") + letter + OFFSET
